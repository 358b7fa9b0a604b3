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
use poly_kernels::cuda::{HostCopies, HostFlags};

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

/// `--fuse host-points`'s launch (`HostCopies::queue_at`): a hand-over's copies and its host point in one
/// launch, captured and replayed token after token. Copies down, then the signal: once the host sees the
/// flag, every word of the token's input is in its page-locked buffer. The wait, then copies up: the card
/// holds at the flag (the stream does not finish), and what arrives is what the host wrote after the card
/// reached the wait and before it set the flag. More words than the launch's one block has threads.
#[test]
fn a_hand_over_launch_waits_copies_and_signals() {
    let Some(dev) = device() else { return };
    let mut flags = HostFlags::new(&dev, 2).unwrap();
    let n = 3000;
    let mut d_src = dev.upload(&vec![0u32; n]).unwrap();
    let mut d_dst = dev.upload(&vec![0u32; n]).unwrap();
    let mut down = dev.pinned::<u32>(n).unwrap();
    let mut up = dev.pinned::<u32>(n).unwrap();
    let graph = dev
        .capture(|dev| {
            let mut copies = HostCopies::new();
            // SAFETY: `down` outlives the graph (dropped after it below) and the host reads it only once
            // the card signalled flag 0, after the copy.
            unsafe { copies.download(&d_src, &mut down)? };
            copies.queue_at(dev, &flags.point_args(None, Some(0), LONG)?)?;
            let mut copies = HostCopies::new();
            // SAFETY: `up` outlives the graph; the host writes it only while the card waits at flag 1.
            unsafe { copies.upload(&up, &mut d_dst)? };
            copies.queue_at(dev, &flags.point_args(Some(1), None, LONG)?)
        })
        .unwrap();
    for t in 0..4u32 {
        let input: Vec<u32> = (0..n as u32).map(|i| i * 7 + t).collect();
        dev.write(&input, &mut d_src).unwrap();
        flags.next_token().unwrap();
        graph.replay().unwrap();
        flags.wait_set(&dev, 0, LONG).unwrap();
        assert_eq!(
            down.as_slice().unwrap(),
            &input[..],
            "token {t}: signalled before its copies"
        );
        // The card waits at flag 1: the stream stays busy until the host sets it.
        std::thread::sleep(Duration::from_millis(10));
        assert!(!dev.query().unwrap(), "token {t}: the wait did not hold");
        let answer: Vec<u32> = (0..n as u32).map(|i| i ^ (t << 20)).collect();
        up.as_mut_slice().unwrap().copy_from_slice(&answer);
        flags.set(1).unwrap();
        dev.synchronize().unwrap();
        assert_eq!(dev.download(&d_dst).unwrap(), answer, "token {t}");
        assert!(flags.card_waited(1).unwrap() >= Duration::from_millis(5));
    }
    assert_eq!(flags.timed_out(), None);
    // A flag out of range is an error, not a launch.
    assert!(flags.point_args(Some(2), None, LONG).is_err());
    assert!(flags.point_args(None, Some(2), LONG).is_err());
    drop(graph);
}
