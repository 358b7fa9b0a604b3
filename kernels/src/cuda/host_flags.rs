//! Flags in page-locked host memory through which one captured graph a token meets the host in its middle.
//!
//! A partly resident token needs the host at every MoE layer: after the router (the host reads the ids and
//! makes the routed experts computable) and after the card's experts (the host adds the CPU's share). Cut
//! into one graph per stretch between such points, every point costs a synchronize (the host waking up)
//! and a graph launch (the card idle until it arrives). With flags the whole token is one graph queued at
//! once: where the card reaches a point it *signals* (`host_signal` writes the token's number into the
//! point's flag, which the host spins on), and where it needs the host it *waits* (`host_wait` spins on a
//! flag that the host, or the host's copy stream after its copies, sets to the token's number). A flag
//! holds the number of the last token that passed it, so nothing is reset between tokens.
//!
//! Neither side waits forever: the card gives up after a time-out and records the token it gave up on
//! (the host reports it as an error), and the host's spin is bounded and watches the stream for faults.
//! A host that fails between points sets every flag ([`HostFlags::release`]) so the card runs to the end.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, LaunchConfig};

use super::module::KernelModule;
use super::{CudaError, CudaResult, Device, PinnedHost};

/// Words before the points' flags: the token's number, and the number of a token the card gave up on.
const HEADER_WORDS: usize = 2;

/// `n` flags, and the token's number, in page-locked memory of one device's context.
pub struct HostFlags {
    words: PinnedHost<u32>,
    /// The host address of `words`, taken once: the slice's own accessors make a driver call each
    /// (an event synchronize), and the flags are touched a few times per MoE layer and token.
    host: *const AtomicU32,
    /// The number of the token under way (never 0, which a new flag holds).
    token: u32,
    /// Per word, the nanoseconds the card last spent waiting at that flag (written by `host_wait`).
    waited: PinnedHost<u64>,
    /// The host address of `waited`, taken once (as `host`).
    waited_host: *const u64,
}

// SAFETY: `host` points into `words` and `waited_host` into `waited`, which this object owns and which
// do not move (page-locked memory); every access through `host`, the host's and the card's, is atomic,
// and `waited` is only read by the host (volatile reads of whole words), so sharing or sending the flags
// between threads races on nothing.
unsafe impl Send for HostFlags {}
// SAFETY: as for `Send`: shared access is atomic loads and stores, and volatile reads.
unsafe impl Sync for HostFlags {}

impl std::fmt::Debug for HostFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostFlags[{}] at token {}", self.len(), self.token)
    }
}

impl HostFlags {
    /// `n` flags (at least one), none set.
    pub fn new(dev: &Device, n: usize) -> CudaResult<HostFlags> {
        if n == 0 || n > i32::MAX as usize - HEADER_WORDS {
            return Err(CudaError::Invalid(format!("{n} host flags")));
        }
        let words = dev.pinned::<u32>(HEADER_WORDS + n)?;
        let host = words.host_ptr()?.cast::<AtomicU32>();
        let waited = dev.pinned::<u64>(HEADER_WORDS + n)?;
        let waited_host = waited.host_ptr()?;
        Ok(HostFlags {
            words,
            host,
            token: 0,
            waited,
            waited_host,
        })
    }

    /// Flags held.
    pub fn len(&self) -> usize {
        self.words.len() - HEADER_WORDS
    }

    /// Whether it holds none (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Word `w` as an atomic the card also reads and writes.
    fn word(&self, w: usize) -> CudaResult<&AtomicU32> {
        if w >= self.words.len() {
            return Err(CudaError::Invalid(format!(
                "host flag word {w} of {}",
                self.words.len()
            )));
        }
        // SAFETY: `host[..len]` is this object's page-locked allocation of u32 (checked index), which lives
        // as long as `self`; AtomicU32 has u32's size and alignment, and every access to these words, the
        // host's and the card's, is atomic (the card's `ld.acquire.sys` / `st.release.sys`).
        Ok(unsafe { &*self.host.add(w) })
    }

    /// Flag `i`'s word, checked.
    fn flag(&self, i: usize) -> CudaResult<&AtomicU32> {
        if i >= self.len() {
            return Err(CudaError::Invalid(format!(
                "host flag {i} of {}",
                self.len()
            )));
        }
        self.word(HEADER_WORDS + i)
    }

    /// Starts the next token: its number written where the card reads it. Call only while no graph
    /// reading the flags runs (after the previous token's last wait).
    pub fn next_token(&mut self) -> CudaResult<u32> {
        self.token = match self.token.wrapping_add(1) {
            0 => 1,
            t => t,
        };
        self.word(0)?.store(self.token, Ordering::Release);
        Ok(self.token)
    }

    /// The token under way.
    pub fn token(&self) -> u32 {
        self.token
    }

    /// Sets flag `i` for the token under way: the host's writes before it are visible to the card's
    /// kernels after the wait on it.
    pub fn set(&self, i: usize) -> CudaResult<()> {
        self.flag(i)?.store(self.token, Ordering::Release);
        Ok(())
    }

    /// Whether flag `i` is set for the token under way.
    pub fn is_set(&self, i: usize) -> CudaResult<bool> {
        Ok(self.flag(i)?.load(Ordering::Acquire) == self.token)
    }

    /// Sets every flag: a host that failed between points lets the card run to the end of its graph.
    pub fn release(&self) {
        for i in 0..self.len() {
            let _ = self.set(i);
        }
    }

    /// The token the card gave up waiting for, if it did since the flags were made.
    pub fn timed_out(&self) -> Option<u32> {
        match self.word(1).map(|w| w.load(Ordering::Acquire)) {
            Ok(0) | Err(_) => None,
            Ok(t) => Some(t),
        }
    }

    /// Spins until the card set flag `i` for the token under way; returns the time spent. Every few
    /// thousand turns it checks the stream for a fault and gives up after `limit`.
    pub fn wait_set(&self, dev: &Device, i: usize, limit: Duration) -> CudaResult<Duration> {
        let flag = self.flag(i)?;
        let clock = Instant::now();
        let mut turns = 0u32;
        while flag.load(Ordering::Acquire) != self.token {
            std::hint::spin_loop();
            turns = turns.wrapping_add(1);
            if turns.is_multiple_of(4096) {
                dev.query()?;
                if clock.elapsed() > limit {
                    return Err(CudaError::Invalid(format!(
                        "the card did not reach host point {i} of token {} in {limit:?}",
                        self.token
                    )));
                }
            }
        }
        Ok(clock.elapsed())
    }

    /// How long the card last waited at flag `i` (its last token's wait). Read only once the card is
    /// past that wait (after the token's end): before, the value is the previous token's.
    pub fn card_waited(&self, i: usize) -> CudaResult<Duration> {
        self.flag(i)?;
        // SAFETY: `waited_host[..len]` is this object's page-locked allocation of u64 (the index is a
        // checked flag's word), alive as long as `self`; the card writes a word only inside `host_wait`,
        // and a volatile read of an aligned u64 sees either the old or the new value.
        let ns = unsafe { std::ptr::read_volatile(self.waited_host.add(HEADER_WORDS + i)) };
        Ok(Duration::from_nanos(ns))
    }

    /// The device address of flag `i`.
    pub fn device_address(&self, i: usize) -> CudaResult<u64> {
        self.flag(i)?;
        Ok(self.words.device_address() + 4 * (HEADER_WORDS + i) as u64)
    }

    /// Queues on the compute stream the card's signal at flag `i` (a capture records it, so every replay
    /// signals with its own token's number).
    pub fn queue_signal(&self, dev: &Device, i: usize) -> CudaResult<()> {
        self.queue_flag_kernel(dev, "host_signal", i, None)
    }

    /// Queues on the compute stream the card's wait for flag `i`, for at most `timeout`.
    pub fn queue_wait(&self, dev: &Device, i: usize, timeout: Duration) -> CudaResult<()> {
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        self.queue_flag_kernel(dev, "host_wait", i, Some(ns))
    }

    fn queue_flag_kernel(
        &self,
        dev: &Device,
        name: &'static str,
        i: usize,
        timeout_ns: Option<u64>,
    ) -> CudaResult<()> {
        self.flag(i)?;
        let f = dev.function(KernelModule::Elementwise, name)?;
        let flags = self.words.device_address();
        let index = (HEADER_WORDS + i) as i32;
        let waited = self.waited.device_address();
        let mut b = dev.launch_builder(&f);
        b.arg(&flags).arg(&index);
        if let Some(ns) = &timeout_ns {
            b.arg(ns).arg(&waited);
        }
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `flags` (and `waited`) are the device addresses of this object's page-locked words and
        // `index` one of its flags (checked), which the kernels alone touch (the host only reads
        // `waited`); the owner keeps the flags alive as long as a
        // queued launch or a graph holding one may run.
        unsafe { b.launch(cfg) }?;
        dev.after_launch(name)
    }

    /// Queues on `stream` the setting of flag `i` to the token under way, after the work queued on it
    /// before (the host's copy stream after a token's copies on demand).
    pub fn queue_set_on(&self, stream: &cudarc::driver::CudaStream, i: usize) -> CudaResult<()> {
        let addr = self.device_address(i)?;
        // SAFETY: `addr` is a flag of this object's page-locked words, alive as long as the owner keeps the
        // flags (past the stream's work: the owner synchronizes before dropping them); flags 0 orders the
        // write after the stream's earlier work, memory included.
        unsafe { sys::cuStreamWriteValue32_v2(stream.cu_stream(), addr, self.token, 0) }
            .result()?;
        Ok(())
    }
}

impl Device {
    /// Whether the compute stream's work so far completed, without waiting; a fault of a kernel run since
    /// the last check is an error.
    pub fn query(&self) -> CudaResult<bool> {
        self.context().bind_to_thread()?;
        // SAFETY: the stream is this device's, alive as long as `self`.
        match unsafe { sys::cuStreamQuery(self.stream().cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(CudaError::Driver(cudarc::driver::DriverError(e))),
        }
    }
}
