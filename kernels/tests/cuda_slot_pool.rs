//! The expert cache's slot pool over several allocations (`SlotPool`): it grows and shrinks by whole
//! allocations with the slots it keeps unchanged, a slot copied across allocations arrives whole, and a
//! count that is not an allocation's boundary is refused.
//!
//! Runs on the GPU machine; without a CUDA device (CI) it prints "skipped: no CUDA device" and passes.

#![cfg(feature = "cuda")]

use poly_kernels::cuda::expert_slots::{CopyStream, SlotPool, SlotRef, StagingBuffer};

mod common;
use common::device;

const SLOT: usize = 96;

/// Writes `slot` of `pool` full of bytes `slot * 7 + 1 + i % 5` (distinct per slot and position).
fn write(pool: &SlotPool, slot: usize, copy: &CopyStream, staging: &mut StagingBuffer) {
    let host = staging.fill().unwrap();
    for (i, b) in host.iter_mut().enumerate() {
        *b = (slot * 7 + 1 + i % 5) as u8;
    }
    let dst = SlotRef {
        pool,
        slot,
        offset: 0,
    };
    copy.copy(staging, SLOT, dst).unwrap();
    copy.synchronize().unwrap();
}

fn pattern(slot: usize) -> Vec<u8> {
    (0..SLOT).map(|i| (slot * 7 + 1 + i % 5) as u8).collect()
}

#[test]
fn a_pool_resizes_by_whole_allocations_keeping_its_slots() {
    let Some(dev) = device() else { return };
    let copy = CopyStream::new(&dev).unwrap();
    let mut staging = StagingBuffer::new(&dev, SLOT).unwrap();
    // 10 slots in allocations of 3: 0-2, 3-5, 6-8, 9.
    let mut pool = SlotPool::alloc_in(&dev, (SLOT, 3), 10).unwrap();
    assert_eq!((pool.n_slots(), pool.bytes()), (10, 10 * SLOT));
    for slot in 0..10 {
        write(&pool, slot, &copy, &mut staging);
    }
    for (n, boundary) in [(0, 0), (2, 0), (3, 3), (7, 6), (9, 9), (10, 10), (12, 10)] {
        assert_eq!(pool.boundary_at_or_below(n), boundary, "{n}");
    }
    // Growing adds zeroed slots after the last and changes none before.
    pool.grow(&dev, 5).unwrap();
    assert_eq!((pool.n_slots(), pool.bytes()), (15, 15 * SLOT));
    for slot in 0..10 {
        assert_eq!(pool.read(&dev, slot).unwrap(), pattern(slot), "slot {slot}");
    }
    assert_eq!(pool.read(&dev, 14).unwrap(), vec![0u8; SLOT]);
    // A slot copied on the card from one allocation into another.
    write(&pool, 12, &copy, &mut staging);
    dev.copy_slot((&pool, 12), (&pool, 2)).unwrap();
    assert_eq!(pool.read(&dev, 2).unwrap(), pattern(12));
    // Shrinking frees whole allocations only, and keeps what is below.
    assert!(pool.truncate(7).is_err());
    assert_eq!(pool.n_slots(), 15);
    pool.truncate(6).unwrap();
    assert_eq!((pool.n_slots(), pool.bytes()), (6, 6 * SLOT));
    for slot in [0, 1, 3, 4, 5] {
        assert_eq!(pool.read(&dev, slot).unwrap(), pattern(slot), "slot {slot}");
    }
    assert_eq!(pool.read(&dev, 2).unwrap(), pattern(12));
    assert!(
        pool.read(&dev, 6).is_err(),
        "a freed slot is out of the pool"
    );
    // And grows again from there.
    pool.grow(&dev, 4).unwrap();
    assert_eq!(pool.n_slots(), 10);
    assert_eq!(pool.read(&dev, 9).unwrap(), vec![0u8; SLOT]);
}
