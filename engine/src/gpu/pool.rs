//! Device buffers kept for reuse between operations and forward calls, by exact length (the kernels check
//! lengths exactly): an activation's buffer goes back to the pool when the activation is dropped, scratch
//! buffers right after the launches that use them. Everything runs on the device's one compute stream, in
//! call order, so a buffer handed out again is written only after the launches that read it before.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use poly_kernels::cuda::{BlockQ8_1, CudaResult, Device, DeviceBuffer};

/// Free buffers of one element type, by length.
pub struct Free<T> {
    by_len: HashMap<usize, Vec<DeviceBuffer<T>>>,
}

impl<T> Default for Free<T> {
    fn default() -> Self {
        Free {
            by_len: HashMap::new(),
        }
    }
}

impl<T> Free<T> {
    fn take(
        &mut self,
        len: usize,
        alloc: impl FnOnce(usize) -> CudaResult<DeviceBuffer<T>>,
    ) -> CudaResult<DeviceBuffer<T>> {
        match self.by_len.get_mut(&len).and_then(|v| v.pop()) {
            Some(b) => Ok(b),
            None => alloc(len),
        }
    }

    fn put(&mut self, b: DeviceBuffer<T>) {
        self.by_len.entry(b.len()).or_default().push(b);
    }
}

/// The free buffers of a backend, kept between forward calls.
#[derive(Default)]
pub struct PoolStore {
    f32: Free<f32>,
    i32: Free<i32>,
    q8: Free<BlockQ8_1>,
    /// Buffers of zeros that are never written (expert 0 for every slot of a one-matrix expert launch),
    /// made once per length so no call copies them from the host.
    zeros_i32: HashMap<usize, Arc<DeviceBuffer<i32>>>,
}

/// The pool as a forward call uses it: shared by the activations it hands out (which give their buffer
/// back when dropped).
pub struct Pool {
    store: RefCell<PoolStore>,
}

impl Pool {
    pub fn new(store: PoolStore) -> Rc<Pool> {
        Rc::new(Pool {
            store: RefCell::new(store),
        })
    }

    /// The store, once no activation holds the pool any more.
    pub fn into_store(pool: Rc<Pool>) -> Option<PoolStore> {
        Rc::try_unwrap(pool).ok().map(|p| p.store.into_inner())
    }

    pub fn f32(&self, dev: &Device, len: usize) -> CudaResult<DeviceBuffer<f32>> {
        self.store.borrow_mut().f32.take(len, |n| dev.zeros(n))
    }

    pub fn put_f32(&self, b: DeviceBuffer<f32>) {
        self.store.borrow_mut().f32.put(b);
    }

    pub fn i32(&self, dev: &Device, len: usize) -> CudaResult<DeviceBuffer<i32>> {
        self.store.borrow_mut().i32.take(len, |n| dev.zeros(n))
    }

    pub fn put_i32(&self, b: DeviceBuffer<i32>) {
        self.store.borrow_mut().i32.put(b);
    }

    /// `len` zeros, never to be written.
    pub fn zeros_i32(&self, dev: &Device, len: usize) -> CudaResult<Arc<DeviceBuffer<i32>>> {
        let mut store = self.store.borrow_mut();
        if let Some(z) = store.zeros_i32.get(&len) {
            return Ok(z.clone());
        }
        let z = Arc::new(dev.zeros(len)?);
        store.zeros_i32.insert(len, z.clone());
        Ok(z)
    }

    pub fn q8(&self, dev: &Device, len: usize) -> CudaResult<DeviceBuffer<BlockQ8_1>> {
        self.store.borrow_mut().q8.take(len, |n| dev.zeros(n))
    }

    pub fn put_q8(&self, b: DeviceBuffer<BlockQ8_1>) {
        self.store.borrow_mut().q8.put(b);
    }
}
