//! Page-locked flags between the card and the host (`HostFlags`): the card's signal reaches the host with
//! the token's number, the card's wait holds the stream until the host (or the copy stream, after its
//! copies) sets the flag, a wait nobody answers gives up and says so, and a captured graph of them works
//! token after token without resetting anything.
//!
//! Runs on the GPU machine; without a CUDA device (CI) each test prints "skipped: no CUDA device" and
//! passes.

#![cfg(feature = "cuda")]

use std::time::{Duration, Instant};

use poly_kernels::cuda::expert_slots::CopyStream;
use poly_kernels::cuda::HostFlags;

mod common;
use common::device;

const LONG: Duration = Duration::from_secs(5);

/// Spins for `d` and says whether flag `i` stayed unset for the token under way the whole time.
fn stays_unset(flags: &HostFlags, i: usize, d: Duration) -> bool {
    let clock = Instant::now();
    while clock.elapsed() < d {
        if flags.is_set(i).unwrap() {
            return false;
        }
    }
    true
}

#[test]
fn the_card_signals_and_waits_for_the_host() {
    let Some(dev) = device() else { return };
    let mut flags = HostFlags::new(&dev, 3).unwrap();
    let t = flags.next_token().unwrap();
    flags.queue_signal(&dev, 0).unwrap();
    flags.wait_set(&dev, 0, LONG).unwrap();
    // The card waits at flag 1 before it signals flag 2: flag 2 stays unset until the host sets 1.
    flags.queue_wait(&dev, 1, LONG).unwrap();
    flags.queue_signal(&dev, 2).unwrap();
    assert!(stays_unset(&flags, 2, Duration::from_millis(50)));
    flags.set(1).unwrap();
    flags.wait_set(&dev, 2, LONG).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(flags.timed_out(), None);
    // The next token's number: the old flags no longer count as set.
    let t2 = flags.next_token().unwrap();
    assert_ne!(t, t2);
    assert!(!flags.is_set(0).unwrap() && !flags.is_set(2).unwrap());
    // A flag out of range is an error, not a write.
    assert!(flags.set(3).is_err());
    assert!(flags.queue_signal(&dev, 3).is_err());
}

#[test]
fn the_copy_stream_sets_a_flag_after_its_copies() {
    let Some(dev) = device() else { return };
    let mut flags = HostFlags::new(&dev, 2).unwrap();
    let copy = CopyStream::new(&dev).unwrap();
    // Both kernels launched once before either spins (flag 0 holds token 0 here: the wait returns at
    // once), as a graph's capture launches them: a kernel's first launch loads it (CUDA's lazy
    // loading), and this test, launching `host_signal` for the first time behind a spinning
    // `host_wait`, saw the launch wait for the card until the wait's time-out, on the H100 and the H200.
    flags.queue_wait(&dev, 0, LONG).unwrap();
    flags.queue_signal(&dev, 1).unwrap();
    copy.set_flag(&flags, 0).unwrap();
    copy.synchronize().unwrap();
    dev.synchronize().unwrap();
    for _ in 0..3 {
        flags.next_token().unwrap();
        flags.queue_wait(&dev, 0, LONG).unwrap();
        flags.queue_signal(&dev, 1).unwrap();
        assert!(stays_unset(&flags, 1, Duration::from_millis(20)));
        copy.set_flag(&flags, 0).unwrap();
        flags.wait_set(&dev, 1, LONG).unwrap();
        dev.synchronize().unwrap();
    }
    assert_eq!(flags.timed_out(), None);
}

#[test]
fn a_wait_nobody_answers_gives_up_and_says_so() {
    let Some(dev) = device() else { return };
    let mut flags = HostFlags::new(&dev, 1).unwrap();
    let t = flags.next_token().unwrap();
    let clock = Instant::now();
    flags
        .queue_wait(&dev, 0, Duration::from_millis(20))
        .unwrap();
    dev.synchronize().unwrap();
    assert!(clock.elapsed() >= Duration::from_millis(20));
    assert_eq!(flags.timed_out(), Some(t));
    // The host's own wait is bounded too: nothing signals flag 0.
    let clock = Instant::now();
    assert!(flags.wait_set(&dev, 0, Duration::from_millis(30)).is_err());
    assert!(clock.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_captured_graph_meets_the_host_token_after_token() {
    let Some(dev) = device() else { return };
    let mut flags = HostFlags::new(&dev, 4).unwrap();
    let graph = dev
        .capture(|dev| {
            flags.queue_signal(dev, 0)?;
            flags.queue_wait(dev, 1, LONG)?;
            flags.queue_signal(dev, 2)?;
            flags.queue_wait(dev, 3, LONG)
        })
        .unwrap();
    for _ in 0..5 {
        flags.next_token().unwrap();
        graph.replay().unwrap();
        flags.wait_set(&dev, 0, LONG).unwrap();
        assert!(stays_unset(&flags, 2, Duration::from_millis(10)));
        flags.set(1).unwrap();
        flags.wait_set(&dev, 2, LONG).unwrap();
        assert!(!dev.query().unwrap());
        flags.set(3).unwrap();
        dev.synchronize().unwrap();
        assert!(dev.query().unwrap());
    }
    assert_eq!(flags.timed_out(), None);
}
