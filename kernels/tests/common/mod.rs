//! Helpers the CUDA test and bench binaries share: the device (or a skip on a machine without one), the
//! error measure every GPU op is held to against its CPU op, and random inputs. Each binary uses a part.
#![allow(dead_code)]

use poly_kernels::cuda::{CudaError, Device};
use poly_kernels::quant::{fill_random, GgmlType};
use poly_kernels::rng::Rng;
use std::sync::Arc;

// Re-exported for the binaries that use it (each binary uses a part of this module).
#[allow(unused_imports)]
pub use poly_kernels::quant::I_QUANTS;

/// Device 0, or `None` (after saying so) when this machine has none.
pub fn device() -> Option<Arc<Device>> {
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(CudaError::NoDevice(why)) => {
            println!("skipped: no CUDA device ({why})");
            None
        }
        Err(e) => panic!("CUDA device 0 is present but does not open: {e}"),
    }
}

/// NMSE = Σ(gpu − cpu)² / Σ cpu².
pub fn nmse(gpu: &[f32], cpu: &[f32]) -> f64 {
    assert_eq!(gpu.len(), cpu.len());
    let err: f64 = gpu
        .iter()
        .zip(cpu)
        .map(|(&g, &c)| (g as f64 - c as f64).powi(2))
        .sum();
    let norm: f64 = cpu.iter().map(|&c| (c as f64).powi(2)).sum();
    err / norm.max(f64::MIN_POSITIVE)
}

/// `n` standard normal values.
pub fn normals(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

/// `n_values` random weights of `ty` (valid blocks of values around ±0.05).
pub fn random_weights(ty: GgmlType, rng: &mut Rng, n_values: usize) -> Vec<u8> {
    let mut w = vec![0u8; ty.bytes_for(n_values as u64).expect("whole blocks") as usize];
    fill_random(ty, rng, 0.05, &mut w).expect("a weight format");
    w
}

/// Fails the test with every collected failure, one per line, if there is any.
pub fn assert_no_failures(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
