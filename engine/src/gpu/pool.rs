//! Device buffers kept for reuse between operations and forward calls, by exact length (the kernels check
//! lengths exactly): an activation's buffer goes back to the pool when the activation is dropped, scratch
//! buffers right after the launches that use them. Everything runs on the device's one compute stream, in
//! call order, so a buffer handed out again is written only after the launches that read it before.
//!
//! Kept by exact length, calls of different sizes (a prompt's last part, a conversation's turns) would
//! each leave a set of buffers behind. A store may be capped ([`PoolStore::cap_at_current`], after the
//! warm-up call of the largest size whose buffers the VRAM budget was measured with): a buffer it must
//! make beyond the cap first frees kept buffers of other lengths, largest first (freed in stream order,
//! so the launches queued before still read them), so its buffers stay within what the budget counted.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use poly_kernels::cuda::ops::Tickets;
use poly_kernels::cuda::{
    BlockQ8_1, CudaResult, Device, DeviceBuffer, DeviceRepr, ValidAsZeroBits,
};

/// Tickets of one set ([`Pool::tickets`]): more than any launch of a model's shapes counts on (a one-token
/// down projection's block columns, rows / 1..4; a gate and up launch's 32-row pieces, slots × rows / 32).
pub const TICKETS: usize = 1 << 14;

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
    fn pop(&mut self, len: usize) -> Option<DeviceBuffer<T>> {
        self.by_len.get_mut(&len).and_then(Vec::pop)
    }

    fn put(&mut self, b: DeviceBuffer<T>) {
        self.by_len.entry(b.len()).or_default().push(b);
    }

    /// Bytes of the kept buffers.
    fn bytes(&self) -> usize {
        self.by_len
            .iter()
            .map(|(&len, v)| len * v.len() * std::mem::size_of::<T>())
            .sum()
    }

    /// The length of the largest kept buffer, in bytes and elements.
    fn largest(&self) -> Option<(usize, usize)> {
        self.by_len
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(&len, _)| (len * std::mem::size_of::<T>(), len))
            .max()
    }

    /// Frees one kept buffer of `len` elements; its bytes.
    fn free_one(&mut self, len: usize) -> usize {
        let freed = self
            .pop(len)
            .map_or(0, |b| b.len() * std::mem::size_of::<T>());
        self.by_len.retain(|_, v| !v.is_empty());
        freed
    }
}

/// Which kept buffers a capped store frees first: the largest.
fn largest_of(sizes: [Option<(usize, usize)>; 3]) -> Option<(usize, usize)> {
    sizes
        .iter()
        .enumerate()
        .filter_map(|(kind, s)| s.map(|(bytes, len)| (bytes, kind, len)))
        .max()
        .map(|(_, kind, len)| (kind, len))
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
    /// Launch tickets not handed out ([`Pool::tickets`]); never freed, since captured graphs keep their
    /// address.
    tickets: Vec<Tickets>,
    /// Bytes of the f32, i32 and q8 buffers this store made and has not freed (handed out or kept).
    made: usize,
    /// The most `made` may reach before kept buffers of other lengths are freed.
    cap: Option<usize>,
}

impl PoolStore {
    /// Caps the store at the bytes it made so far.
    pub fn cap_at_current(&mut self) {
        self.cap = Some(self.made);
    }

    /// The cap, if any.
    pub fn cap(&self) -> Option<usize> {
        self.cap
    }

    /// Sets the cap (`None`: none); kept buffers are freed by the next buffer made beyond it.
    pub fn set_cap(&mut self, cap: Option<usize>) {
        self.cap = cap;
    }

    /// A store with no buffers and `self`'s cap (after the kept buffers were freed); the launch tickets
    /// move over (tiny, and graphs may hold their address).
    pub fn emptied(&mut self) -> PoolStore {
        PoolStore {
            cap: self.cap,
            tickets: std::mem::take(&mut self.tickets),
            ..PoolStore::default()
        }
    }

    /// Bytes the store's buffers take (handed out or kept).
    pub fn bytes(&self) -> usize {
        self.made
    }

    /// Makes room for a new buffer of `bytes` under the cap by freeing kept buffers, largest first. The
    /// frees are stream-ordered into the driver's pool, which returns memory to the card only at a
    /// synchronization: without one here the new buffer would come on top of the freed ones.
    fn make_room(&mut self, dev: &Device, bytes: usize) -> CudaResult<()> {
        let Some(cap) = self.cap else {
            return Ok(());
        };
        let mut freed_any = false;
        while self.made + bytes > cap {
            let sizes = [self.f32.largest(), self.i32.largest(), self.q8.largest()];
            let freed = match largest_of(sizes) {
                Some((0, len)) => self.f32.free_one(len),
                Some((1, len)) => self.i32.free_one(len),
                Some((_, len)) => self.q8.free_one(len),
                None => break,
            };
            freed_any = true;
            self.made = self.made.saturating_sub(freed);
        }
        if freed_any {
            dev.synchronize()?;
        }
        Ok(())
    }
}

/// The element types a store keeps, each in its own [`Free`].
trait Kept: Sized {
    fn free(store: &mut PoolStore) -> &mut Free<Self>;
}

impl Kept for f32 {
    fn free(store: &mut PoolStore) -> &mut Free<f32> {
        &mut store.f32
    }
}

impl Kept for i32 {
    fn free(store: &mut PoolStore) -> &mut Free<i32> {
        &mut store.i32
    }
}

impl Kept for BlockQ8_1 {
    fn free(store: &mut PoolStore) -> &mut Free<BlockQ8_1> {
        &mut store.q8
    }
}

impl PoolStore {
    /// A kept buffer of `len` elements, else a new one made within the cap.
    fn take<T: Kept + DeviceRepr + ValidAsZeroBits>(
        &mut self,
        dev: &Device,
        len: usize,
    ) -> CudaResult<DeviceBuffer<T>> {
        if let Some(b) = T::free(self).pop(len) {
            return Ok(b);
        }
        let bytes = len * std::mem::size_of::<T>();
        self.make_room(dev, bytes)?;
        let b = dev.zeros(len)?;
        self.made += bytes;
        Ok(b)
    }
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
        Rc::try_unwrap(pool).ok().map(|p| {
            let mut store = p.store.into_inner();
            // Every buffer of the call came back or was dropped: what the store made is what it keeps.
            store.made = store.f32.bytes() + store.i32.bytes() + store.q8.bytes();
            store
        })
    }

    pub fn f32(&self, dev: &Device, len: usize) -> CudaResult<DeviceBuffer<f32>> {
        self.store.borrow_mut().take(dev, len)
    }

    pub fn put_f32(&self, b: DeviceBuffer<f32>) {
        self.store.borrow_mut().f32.put(b);
    }

    pub fn i32(&self, dev: &Device, len: usize) -> CudaResult<DeviceBuffer<i32>> {
        self.store.borrow_mut().take(dev, len)
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

    /// A set of [`TICKETS`] launch tickets (zeros that the kernels counting on them leave zero), made once
    /// and handed out again after [`Pool::put_tickets`].
    pub fn tickets(&self, dev: &Device) -> CudaResult<Tickets> {
        let mut store = self.store.borrow_mut();
        match store.tickets.pop() {
            Some(t) => Ok(t),
            None => Tickets::new(dev, TICKETS),
        }
    }

    pub fn put_tickets(&self, t: Tickets) {
        self.store.borrow_mut().tickets.push(t);
    }

    pub fn q8(&self, dev: &Device, len: usize) -> CudaResult<DeviceBuffer<BlockQ8_1>> {
        self.store.borrow_mut().take(dev, len)
    }

    pub fn put_q8(&self, b: DeviceBuffer<BlockQ8_1>) {
        self.store.borrow_mut().q8.put(b);
    }
}
