//! The device pieces of the VRAM expert cache (issue 8): a [`SlotPool`] (allocations cut into slots of
//! one expert's matrices), expert tables whose entries point into slots or are null
//! ([`ExpertTable::empty`], [`ExpertTable::point`]), pinned [`StagingBuffer`]s and a [`CopyStream`] that
//! copies them into slots beside the compute stream, ordered against it with [`CopyEvent`]s.
//!
//! Ordering rules the engine's cache follows (see `kernels/cuda/README.md`):
//! - a slot is written on the copy stream only after the compute stream passed every launch that may still
//!   read it ([`CopyStream::wait_for_compute`]);
//! - a table entry is pointed at a slot on the compute stream only after the slot's copy completed
//!   ([`Device::wait_for_copy`] before [`ExpertTable::point`]);
//! - a staging buffer is refilled by the host only after its last copy completed ([`StagingBuffer::fill`]
//!   waits for it).
//!
//! A [`HostRegistration`] page-locks host memory the caller keeps mapped (the model file's mapping), so
//! the copy stream reads experts straight from it ([`CopyStream::copy_from_host`]) at the pinned rate,
//! without the host copying them into a staging buffer first.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaEvent, CudaStream, PinnedHostSlice};

use super::buffer::check_shape;
use super::{CudaError, CudaResult, Device, DeviceBuffer, ExpertTable, HostFlags};
use crate::quant::GgmlType;

/// Slots of one allocation of a [`SlotPool`] by default: a pool is cut into allocations of this many slots
/// (the last smaller), so it shrinks by freeing its last allocations and grows by adding some, with the
/// slots it keeps, and the experts in them, where they were (32 slots: 55-85 MB for the 30-35B models).
pub const POOL_CHUNK_SLOTS: usize = 32;

/// `n_slots` slots of `slot_bytes` each, over allocations of at most `chunk_slots` slots.
pub struct SlotPool {
    /// The allocations in slot order; `starts[i]` is the first slot of `chunks[i]`.
    chunks: Vec<DeviceBuffer<u8>>,
    starts: Vec<usize>,
    slot_bytes: usize,
    n_slots: usize,
    chunk_slots: usize,
}

impl std::fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SlotPool[{} × {} B in {} allocations]",
            self.n_slots,
            self.slot_bytes,
            self.chunks.len()
        )
    }
}

impl SlotPool {
    /// Allocates `n_slots` (≥ 1) slots of `slot_bytes` (≥ 1) on `dev`, [`POOL_CHUNK_SLOTS`] an allocation.
    pub fn alloc(dev: &Device, slot_bytes: usize, n_slots: usize) -> CudaResult<SlotPool> {
        SlotPool::alloc_in(dev, (slot_bytes, POOL_CHUNK_SLOTS), n_slots)
    }

    /// [`SlotPool::alloc`] with `chunk_slots` (≥ 1) slots an allocation: what it frees or adds at once.
    pub fn alloc_in(
        dev: &Device,
        (slot_bytes, chunk_slots): (usize, usize),
        n_slots: usize,
    ) -> CudaResult<SlotPool> {
        if slot_bytes == 0
            || n_slots == 0
            || chunk_slots == 0
            || slot_bytes.checked_mul(n_slots).is_none()
        {
            return Err(CudaError::Invalid(format!(
                "slot pool of {n_slots} × {slot_bytes} bytes, {chunk_slots} slots an allocation"
            )));
        }
        let mut pool = SlotPool {
            chunks: Vec::new(),
            starts: Vec::new(),
            slot_bytes,
            n_slots: 0,
            chunk_slots,
        };
        pool.grow(dev, n_slots)?;
        Ok(pool)
    }

    /// Adds `more` slots after the last (their contents zero); on an error the slots added before it stay.
    pub fn grow(&mut self, dev: &Device, more: usize) -> CudaResult<()> {
        let mut left = more;
        while left > 0 {
            let n = left.min(self.chunk_slots);
            let bytes = self.slot_bytes.checked_mul(n).ok_or_else(|| {
                CudaError::Invalid(format!("{n} slots of {} bytes", self.slot_bytes))
            })?;
            self.chunks.push(dev.zeros(bytes)?);
            self.starts.push(self.n_slots);
            self.n_slots += n;
            left -= n;
        }
        Ok(())
    }

    /// The most slots at or below `n` the pool can shrink to ([`SlotPool::truncate`]): the first slot of
    /// an allocation (or all of them, when `n` is at least that).
    pub fn boundary_at_or_below(&self, n: usize) -> usize {
        if n >= self.n_slots {
            return self.n_slots;
        }
        let i = self.starts.partition_point(|&s| s <= n);
        self.starts[i.saturating_sub(1)]
    }

    /// Frees every allocation from slot `n` on: `n` must be a boundary
    /// ([`SlotPool::boundary_at_or_below`]). The caller knows no launch or copy still reads or writes
    /// them (the device synchronized).
    pub fn truncate(&mut self, n: usize) -> CudaResult<()> {
        if n >= self.n_slots {
            return Ok(());
        }
        let Ok(i) = self.starts.binary_search(&n) else {
            return Err(CudaError::Invalid(format!(
                "{n} slots: not a boundary of the pool's allocations"
            )));
        };
        self.chunks.truncate(i);
        self.starts.truncate(i);
        self.n_slots = n;
        Ok(())
    }

    /// Slots.
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes of the pool.
    pub fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.num_bytes()).sum()
    }

    /// The bytes of slot `slot` after every launch and copy queued on `dev`'s compute stream (for tests
    /// and diagnosis).
    pub fn read(&self, dev: &Device, slot: usize) -> CudaResult<Vec<u8>> {
        let addr = self.address(slot, 0, self.slot_bytes)?;
        let mut out = vec![0u8; self.slot_bytes];
        dev.synchronize()?;
        // SAFETY: `addr..addr + slot_bytes` lies in a live allocation of the pool (checked by `address`)
        // and `out` holds as many bytes; the device synchronized, so no queued work writes the slot.
        unsafe { result::memcpy_dtoh_sync(&mut out, addr) }?;
        Ok(out)
    }

    /// The device address of `offset` in slot `slot`, for `len` bytes that must lie inside the slot.
    fn address(&self, slot: usize, offset: usize, len: usize) -> CudaResult<u64> {
        if slot >= self.n_slots || offset.checked_add(len).is_none_or(|e| e > self.slot_bytes) {
            return Err(CudaError::Invalid(format!(
                "slot {slot} bytes {offset}..+{len} outside a pool of {} × {} B",
                self.n_slots, self.slot_bytes
            )));
        }
        let i = self.starts.partition_point(|&s| s <= slot) - 1;
        let within = slot - self.starts[i];
        Ok(self.chunks[i].address() + (within * self.slot_bytes + offset) as u64)
    }
}

/// Where one expert's matrix is: a slot of a pool and its offset there.
#[derive(Clone, Copy, Debug)]
pub struct SlotRef<'p> {
    pub pool: &'p SlotPool,
    pub slot: usize,
    pub offset: usize,
}

/// Where the card reads one expert's matrix: a slot in VRAM, or host memory mapped into the card's
/// address space (page-locked, read over the bus at the link's rate by the kernels themselves).
#[derive(Clone, Copy, Debug)]
pub enum ExpertSource<'p> {
    Slot(SlotRef<'p>),
    Mapped(u64),
}

impl ExpertTable {
    /// A table of `n_expert` experts of `rows × cols` of `ty` with every entry null (no expert on the card:
    /// the kernels write zeros for their slots).
    pub fn empty(
        dev: &Device,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        n_expert: usize,
    ) -> CudaResult<ExpertTable> {
        let [t] = ExpertTable::empty_group(dev, [(ty, rows, cols)], n_expert)?;
        Ok(t)
    }

    /// `N` tables of `n_expert` experts each (`(ty, rows, cols)` per table), every entry null, over one
    /// device array, so [`ExpertTable::point_group`] repoints them all with one copy (a cache layer's
    /// gate, up and down tables change together).
    pub fn empty_group<const N: usize>(
        dev: &Device,
        specs: [(GgmlType, usize, usize); N],
        n_expert: usize,
    ) -> CudaResult<[ExpertTable; N]> {
        for &(ty, rows, cols) in &specs {
            check_shape(ty, rows, cols)?;
        }
        if n_expert == 0 || n_expert > i32::MAX as usize || N == 0 {
            return Err(CudaError::Invalid(format!(
                "{N} tables of {n_expert} experts"
            )));
        }
        let storage = Arc::new(dev.zeros::<u64>(N * n_expert)?);
        let tables: Vec<ExpertTable> = specs
            .iter()
            .enumerate()
            .map(|(i, &(ty, rows, cols))| {
                ExpertTable::over((ty, rows, cols, n_expert), storage.clone(), i * n_expert)
            })
            .collect();
        <[ExpertTable; N]>::try_from(tables)
            .map_err(|_| CudaError::Invalid("a table group of the wrong size".into()))
    }

    /// The device addresses of `entries` (one per expert) for this table's matrices.
    fn entry_addresses(
        &self,
        entries: &[Option<ExpertSource<'_>>],
        out: &mut Vec<u64>,
    ) -> CudaResult<()> {
        if entries.len() != self.n_expert {
            return Err(CudaError::Invalid(format!(
                "{} entries for a table of {} experts",
                entries.len(),
                self.n_expert
            )));
        }
        for s in entries {
            out.push(self.source_address(*s)?);
        }
        Ok(())
    }

    /// Writes `addresses` over `storage[offset..]` in stream order on the compute stream.
    fn write_addresses(&self, dev: &Device, addresses: &[u64]) -> CudaResult<()> {
        if self.offset + addresses.len() > self.storage.len() {
            return Err(CudaError::Invalid(format!(
                "{} addresses at {} of a table array of {}",
                addresses.len(),
                self.offset,
                self.storage.len()
            )));
        }
        // SAFETY: the range lies inside the table's live array (checked above); `addresses` is pageable
        // host memory, which the driver copies out before this returns; stream order on the compute
        // stream orders the write against every launch that reads the table.
        unsafe { result::memcpy_htod_async(self.address, addresses, dev.stream().cu_stream()) }?;
        Ok(())
    }

    /// [`ExpertTable::point`] where an entry may also be a host address the card reads over the bus
    /// (`ExpertSource::Mapped`, from [`HostRegistration::device_address`]).
    pub fn point_sources(
        &mut self,
        dev: &Device,
        entries: &[Option<ExpertSource<'_>>],
    ) -> CudaResult<()> {
        let mut addresses = Vec::with_capacity(entries.len());
        self.entry_addresses(entries, &mut addresses)?;
        self.write_addresses(dev, &addresses)
    }

    /// Whether `tables` lie one after another in one array (a group of [`ExpertTable::empty_group`]),
    /// so one copy writes them all.
    fn one_array(tables: &[ExpertTable]) -> bool {
        tables.windows(2).all(|w| {
            Arc::ptr_eq(&w[0].storage, &w[1].storage) && w[1].offset == w[0].offset + w[0].n_expert
        })
    }

    /// The address an entry pointing at `source` holds (0 for `None`): for entries a caller writes into
    /// page-locked memory itself and uploads with [`ExpertTable::queue_group_upload`].
    pub fn source_address(&self, source: Option<ExpertSource<'_>>) -> CudaResult<u64> {
        match source {
            Some(ExpertSource::Slot(s)) => s.pool.address(s.slot, s.offset, self.expert_bytes()),
            Some(ExpertSource::Mapped(a)) => Ok(a),
            None => Ok(0),
        }
    }

    /// Queues on the compute stream the copy of `addresses` (page-locked, one per entry of each table
    /// in turn) over a group made by [`ExpertTable::empty_group`]; a graph being captured records it as
    /// a node, so every replay copies what the host wrote there before it.
    ///
    /// # Safety
    /// The host must not write `addresses` while a queued copy (or a replay holding it) may still read
    /// them, and must keep them alive as long as such a copy or graph may run.
    pub unsafe fn queue_group_upload(
        dev: &Device,
        tables: &[ExpertTable],
        addresses: &super::PinnedHost<u64>,
    ) -> CudaResult<()> {
        let first = ExpertTable::group_start(tables, addresses.len())?;
        let n = addresses.len();
        let src = addresses.host_ptr()?;
        // SAFETY: `src[..n]` is page-locked memory of this context (the caller keeps it alive and
        // unwritten until the copy ran); the destination range lies inside the group's array (checked
        // above); stream order on the compute stream orders it against the launches reading the tables.
        unsafe {
            let host = std::slice::from_raw_parts(src, n);
            result::memcpy_htod_async(first, host, dev.stream().cu_stream())
        }?;
        Ok(())
    }

    /// [`ExpertTable::queue_group_upload`] as one of `copies` (made by a kernel with the others, when they
    /// are queued) instead of a copy-engine transfer of its own.
    ///
    /// # Safety
    /// As [`ExpertTable::queue_group_upload`], until the stream passed the launch of `copies`.
    pub unsafe fn add_group_upload(
        copies: &mut super::HostCopies,
        tables: &[ExpertTable],
        addresses: &super::PinnedHost<u64>,
    ) -> CudaResult<()> {
        let first = ExpertTable::group_start(tables, addresses.len())?;
        // SAFETY: the destination holds the group's `addresses.len()` entries (checked by `group_start`);
        // the caller's contract covers the host side.
        unsafe { copies.upload_to(addresses, first) }?;
        Ok(())
    }

    /// The device address of a group's first entry, checked to hold `n` entries of the group.
    fn group_start(tables: &[ExpertTable], n: usize) -> CudaResult<u64> {
        let entries: usize = tables.iter().map(|t| t.n_expert).sum();
        let first = tables
            .first()
            .filter(|t| ExpertTable::one_array(tables) && t.offset + entries <= t.storage.len())
            .ok_or_else(|| CudaError::Invalid("an upload over tables of no group".into()))?;
        if n != entries {
            return Err(CudaError::Invalid(format!(
                "{n} addresses for a table group of {entries} entries"
            )));
        }
        Ok(first.address)
    }

    /// Repoints a group of tables made by [`ExpertTable::empty_group`] (`tables` in its order, with
    /// `entries[i]` for `tables[i]`) with one copy; tables of separate arrays get one copy each.
    pub fn point_group(
        dev: &Device,
        tables: &mut [ExpertTable],
        entries: &[Vec<Option<ExpertSource<'_>>>],
    ) -> CudaResult<()> {
        if tables.len() != entries.len() || tables.is_empty() {
            return Err(CudaError::Invalid(format!(
                "{} entry lists for {} tables",
                entries.len(),
                tables.len()
            )));
        }
        if !ExpertTable::one_array(tables) {
            for (t, e) in tables.iter_mut().zip(entries) {
                t.point_sources(dev, e)?;
            }
            return Ok(());
        }
        let mut addresses = Vec::with_capacity(entries.iter().map(Vec::len).sum());
        for (t, e) in tables.iter().zip(entries) {
            t.entry_addresses(e, &mut addresses)?;
        }
        tables[0].write_addresses(dev, &addresses)
    }

    /// Rewrites the whole table in stream order on the compute stream: entry `e` points at `entries[e]`
    /// or is null. Launches queued before read the old entries, launches queued after the new ones. The
    /// pools must outlive every launch that reads the table while it points into them.
    pub fn point(&mut self, dev: &Device, entries: &[Option<SlotRef<'_>>]) -> CudaResult<()> {
        let sources: Vec<Option<ExpertSource<'_>>> =
            entries.iter().map(|e| e.map(ExpertSource::Slot)).collect();
        self.point_sources(dev, &sources)
    }
}

/// A point in the copy stream's work: waited on by the compute stream or the host.
pub struct CopyEvent {
    event: CudaEvent,
}

impl CopyEvent {
    /// Whether the work before it completed (false on an error, which the next wait reports).
    pub fn is_complete(&self) -> bool {
        self.event.is_complete()
    }

    /// Blocks the calling thread (yielding, not spinning) until the work before it completed.
    pub fn wait(&self) -> CudaResult<()> {
        Ok(self.event.synchronize()?)
    }
}

impl Device {
    /// Makes the compute stream wait (on the card, without blocking the host) for `event`.
    pub fn wait_for_copy(&self, event: &CopyEvent) -> CudaResult<()> {
        Ok(self.stream().wait(&event.event)?)
    }

    /// An event after everything queued on the compute stream so far.
    pub fn record_compute(&self) -> CudaResult<CopyEvent> {
        let event = self
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
        event.record(self.stream())?;
        Ok(CopyEvent { event })
    }

    /// Queues on the compute stream a copy of slot `src.1` of pool `src.0` into slot `dst.1` of `dst.0`
    /// (pools of one slot size): after the launches queued before it, which may still read either, and
    /// before those queued after, which see the copy (an expert the card holds in a scratch slot admitted
    /// into the cache at the card's memory rate instead of over the bus again).
    pub fn copy_slot(
        &self,
        (src_pool, src_slot): (&SlotPool, usize),
        (dst_pool, dst_slot): (&SlotPool, usize),
    ) -> CudaResult<()> {
        slot_copy((src_pool, src_slot), (dst_pool, dst_slot), self.stream())
    }
}

/// A slot copied into another on `stream` (see [`Device::copy_slot`] for the ordering each caller keeps).
fn slot_copy(
    (src_pool, src_slot): (&SlotPool, usize),
    (dst_pool, dst_slot): (&SlotPool, usize),
    stream: &CudaStream,
) -> CudaResult<()> {
    if src_pool.slot_bytes != dst_pool.slot_bytes {
        return Err(CudaError::Invalid(format!(
            "a slot copy between pools of {} and {} B slots",
            src_pool.slot_bytes, dst_pool.slot_bytes
        )));
    }
    let len = src_pool.slot_bytes;
    let from = src_pool.address(src_slot, 0, len)?;
    let to = dst_pool.address(dst_slot, 0, len)?;
    if std::ptr::eq(src_pool, dst_pool) && src_slot == dst_slot {
        return Ok(());
    }
    // SAFETY: both ranges lie inside live allocations (checked by `address`) and are distinct slots (one
    // slot never overlaps another); the callers order the copy against every launch reading or writing
    // them (stream order on the compute stream, or a host point where the card reads neither).
    unsafe { result::memcpy_dtod_async(to, from, len, stream.cu_stream()) }?;
    Ok(())
}

/// Page-locked host memory the copy stream reads from, with the event of its last copy.
pub struct StagingBuffer {
    host: PinnedHostSlice<u8>,
    /// Recorded after the last copy out of `host`.
    last_copy: Option<CudaEvent>,
}

impl StagingBuffer {
    /// `bytes` (≥ 1) of pinned memory.
    pub fn new(dev: &Device, bytes: usize) -> CudaResult<StagingBuffer> {
        if bytes == 0 {
            return Err(CudaError::Invalid("a staging buffer of 0 bytes".into()));
        }
        // Write-combined: the host only writes it and the card only reads it.
        // SAFETY: the memory is uninitialized; `fill` hands it out only for writing first (callers write
        // before a copy reads it, and a copy reads only the bytes asked for).
        let host = unsafe {
            dev.context()
                .alloc_pinned_with_flags::<u8>(bytes, sys::CU_MEMHOSTALLOC_WRITECOMBINED)
        }?;
        Ok(StagingBuffer {
            host,
            last_copy: None,
        })
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The buffer to write, once its last copy completed (the thread blocks until then).
    pub fn fill(&mut self) -> CudaResult<&mut [u8]> {
        if let Some(e) = self.last_copy.take() {
            e.synchronize()?;
        }
        // cudarc's own event of the slice is never recorded (event tracking is off), so this does not
        // wait; ours above did.
        Ok(self.host.as_mut_slice()?)
    }
}

/// Host memory page-locked for the card's copies (`cuMemHostRegister`, read-only) and mapped into the
/// card's address space (kernels may read it over the bus), unregistered when dropped. It keeps `owner`
/// (what keeps the memory mapped) alive as long as it lives.
pub struct HostRegistration {
    ptr: *const u8,
    len: usize,
    /// The card's address of `ptr`.
    device_ptr: u64,
    ctx: Arc<cudarc::driver::CudaContext>,
    _owner: Arc<dyn std::any::Any + Send + Sync>,
}

// SAFETY: the registration only holds the address of memory `owner` keeps mapped and unchanged (the
// contract of `new`); reading it from any thread is sound.
unsafe impl Send for HostRegistration {}
// SAFETY: as for Send: no interior mutability.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Page-locks `memory` for copies to `dev`.
    ///
    /// # Safety
    /// `memory` must stay mapped, readable and unchanged as long as `owner` lives.
    pub unsafe fn new(
        dev: &Device,
        memory: &[u8],
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> CudaResult<HostRegistration> {
        if memory.is_empty() {
            return Err(CudaError::Invalid("registering no memory".into()));
        }
        let ctx = dev.context().clone();
        ctx.bind_to_thread()?;
        // SAFETY: the range is mapped and readable (the caller's contract); the card only reads it.
        unsafe {
            sys::cuMemHostRegister_v2(
                memory.as_ptr() as *mut std::ffi::c_void,
                memory.len(),
                sys::CU_MEMHOSTREGISTER_READ_ONLY
                    | sys::CU_MEMHOSTREGISTER_PORTABLE
                    | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
            .result()?;
        }
        let mut device_ptr: sys::CUdeviceptr = 0;
        // SAFETY: the range was registered just above with DEVICEMAP; the call only writes `device_ptr`.
        let mapped = unsafe {
            sys::cuMemHostGetDevicePointer_v2(
                &mut device_ptr,
                memory.as_ptr() as *mut std::ffi::c_void,
                0,
            )
            .result()
        };
        if let Err(e) = mapped {
            // SAFETY: registered above, not used since.
            let _ = unsafe { sys::cuMemHostUnregister(memory.as_ptr() as *mut std::ffi::c_void) };
            return Err(e.into());
        }
        Ok(HostRegistration {
            ptr: memory.as_ptr(),
            len: memory.len(),
            device_ptr,
            ctx,
            _owner: owner,
        })
    }

    /// Whether `s` lies inside the registered memory.
    pub fn contains(&self, s: &[u8]) -> bool {
        let (a, b) = (self.ptr as usize, self.ptr as usize + self.len);
        let (p, q) = (s.as_ptr() as usize, s.as_ptr() as usize + s.len());
        p >= a && q <= b
    }

    /// The card's address of `s` (inside the registered memory), which kernels may read over the bus.
    pub fn device_address(&self, s: &[u8]) -> Option<u64> {
        self.contains(s)
            .then(|| self.device_ptr + (s.as_ptr() as usize - self.ptr as usize) as u64)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // Copies from it were waited for by its user (see `CopyStream::copy_from_host`).
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` was registered by `new` and is still mapped (`owner` is dropped after this).
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
    }
}

/// A stream for copies into slots, beside the compute stream.
pub struct CopyStream {
    stream: Arc<CudaStream>,
}

impl CopyStream {
    /// A new stream on `dev`'s context.
    pub fn new(dev: &Device) -> CudaResult<CopyStream> {
        Ok(CopyStream {
            stream: dev.context().new_stream()?,
        })
    }

    /// Makes the copies queued after this wait for everything queued on `dev`'s compute stream so far
    /// (so a slot is overwritten only after the launches that read it).
    pub fn wait_for_compute(&self, dev: &Device) -> CudaResult<()> {
        let e = dev.record_compute()?;
        self.wait_for(&e)
    }

    /// Makes the copies queued from here on wait for `event` (a point of the compute stream recorded
    /// earlier by [`Device::record_compute`]: the launches before it, not those queued since).
    pub fn wait_for(&self, event: &CopyEvent) -> CudaResult<()> {
        Ok(self.stream.wait(&event.event)?)
    }

    /// Queues a copy of `src[..len]` into `dst` (`len` bytes inside one slot).
    pub fn copy(&self, src: &mut StagingBuffer, len: usize, dst: SlotRef<'_>) -> CudaResult<()> {
        if len > src.len() {
            return Err(CudaError::Invalid(format!(
                "a copy of {len} bytes from a staging buffer of {}",
                src.len()
            )));
        }
        let addr = dst.pool.address(dst.slot, dst.offset, len)?;
        let ptr = src.host.as_ptr()?;
        // SAFETY: `ptr[..len]` is pinned memory owned by `src` (len checked above), which is not written
        // again before `last_copy` (recorded just below) completed (`fill` waits for it), and is freed only
        // after it (PinnedHostSlice's drop synchronizes the context's work on it, and the buffer's owner
        // drops the stream's work first, see `ExpertCache`); `addr..addr+len` lies in the pool's slot
        // (checked by `address`).
        unsafe {
            let host = std::slice::from_raw_parts(ptr, len);
            result::memcpy_htod_async(addr, host, self.stream.cu_stream())?;
        }
        let event = self
            .stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
        event.record(&self.stream)?;
        src.last_copy = Some(event);
        Ok(())
    }

    /// Queues a copy of `src` (inside `reg`) into `dst`. The caller keeps `reg` until the copy completed
    /// (an event recorded after it, or [`CopyStream::synchronize`]).
    pub fn copy_from_host(
        &self,
        reg: &HostRegistration,
        src: &[u8],
        dst: SlotRef<'_>,
    ) -> CudaResult<()> {
        if !reg.contains(src) {
            return Err(CudaError::Invalid(
                "a copy from memory outside its registration".into(),
            ));
        }
        let addr = dst.pool.address(dst.slot, dst.offset, src.len())?;
        // SAFETY: `src` lies in page-locked memory that stays mapped and unchanged while `reg` lives (its
        // contract), which the caller keeps until the copy completed; `addr..addr+len` lies in the slot.
        unsafe { result::memcpy_htod_async(addr, src, self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Queues on this stream a copy of slot `src.1` of pool `src.0` into slot `dst.1` of `dst.0` (pools
    /// of one slot size), in order with the copies queued here. The caller knows the compute stream does
    /// not read either slot meanwhile (a one-graph token's host point, where the card waits for the host).
    pub fn copy_slot(
        &self,
        (src_pool, src_slot): (&SlotPool, usize),
        (dst_pool, dst_slot): (&SlotPool, usize),
    ) -> CudaResult<()> {
        slot_copy((src_pool, src_slot), (dst_pool, dst_slot), &self.stream)
    }

    /// Queues the setting of `flags`' flag `i` to their token after the copies queued so far: the card
    /// waiting on it reads them complete.
    pub fn set_flag(&self, flags: &HostFlags, i: usize) -> CudaResult<()> {
        flags.queue_set_on(&self.stream, i)
    }

    /// An event after every copy queued so far.
    pub fn record(&self) -> CudaResult<CopyEvent> {
        let event = self
            .stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
        event.record(&self.stream)?;
        Ok(CopyEvent { event })
    }

    /// Waits for every copy queued so far.
    pub fn synchronize(&self) -> CudaResult<()> {
        Ok(self.stream.synchronize()?)
    }
}
