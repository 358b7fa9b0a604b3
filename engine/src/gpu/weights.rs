//! The model's weights on the card, uploaded once at load in the file's own types:
//!
//! - a quantized matrix the GPU computes as a [`DeviceMatrix`] (matrix×vector for one token,
//!   matrix×matrix for a batch);
//! - a float matrix (F32, F16, BF16) as a one-expert [`StackedExperts`], so one launch of the float
//!   expert kernel multiplies every token of a batch by it (each token a slot of expert 0);
//! - a 3-D expert tensor as [`StackedExperts`]: the kernels find each expert through its table; the
//!   routed experts of MoE layers are left to the VRAM expert cache ([`super::expert_cache`]) instead;
//! - a matrix of a type the GPU does not compute yet, dequantized to F32 at upload;
//! - the small vectors element-wise operations read (norm weights, biases, conv kernels) as f32 on first
//!   use.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use poly_kernels::cuda::ops::{activation_form, ActivationForm};
use poly_kernels::cuda::{
    CudaError, CudaResult, Device, DeviceBuffer, DeviceMatrix, StackedExperts,
};
use poly_kernels::quant::{dequantize, GgmlType};
use poly_models::compute::WeightId;

use crate::cpu::CpuWeights;

/// One weight on the card.
pub enum GpuWeight {
    /// A quantized matrix `[rows, cols]`.
    Quant(DeviceMatrix),
    /// A float matrix as expert 0 of a one-expert table.
    Float(StackedExperts),
    /// `n_expert` matrices of one tensor.
    Experts(StackedExperts),
}

/// Every weight of a file on the card.
pub struct GpuWeights {
    mats: Vec<Option<GpuWeight>>,
    vectors: Mutex<HashMap<u32, Arc<DeviceBuffer<f32>>>>,
    bytes: usize,
}

/// The tensor's bytes as F32, when its type is not one the card computes.
fn as_f32_bytes(cpu: &CpuWeights, w: WeightId) -> Vec<u8> {
    let info = cpu.info(w);
    let mut out = vec![0f32; info.n_elements() as usize];
    // Bound tensors dequantize (the architecture checked their types at bind time).
    if dequantize(info.ty, cpu.bytes(w), &mut out).is_err() {
        out.iter_mut().for_each(|v| *v = f32::NAN);
    }
    out.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn upload_one(dev: &Device, cpu: &CpuWeights, w: WeightId) -> CudaResult<Option<GpuWeight>> {
    let info = cpu.info(w);
    let dims: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
    let (cols, rows, n_mat) = match dims.as_slice() {
        // A vector is also a one-row matrix (a shared-expert gate `[n_embd]` whose trailing 1 the file
        // dropped); the element-wise operations read their own f32 copy.
        [c] => (*c, 1, 1),
        [c, r] => (*c, *r, 1),
        [c, r, e] => (*c, *r, *e),
        [c, r, e, 1] => (*c, *r, *e),
        // Vectors go up as f32 on first use; other shapes are not matrices.
        _ => return Ok(None),
    };
    if rows == 0 || cols == 0 || n_mat == 0 {
        return Ok(None);
    }
    let native = activation_form(info.ty).is_some();
    let (ty, converted);
    let data: &[u8] = if native {
        ty = info.ty;
        cpu.bytes(w)
    } else {
        ty = GgmlType::F32;
        converted = as_f32_bytes(cpu, w);
        &converted
    };
    let upload = if dims.len() >= 3 {
        StackedExperts::upload(dev, ty, (rows, cols, n_mat), data).map(GpuWeight::Experts)
    } else {
        match activation_form(ty) {
            Some(ActivationForm::Q8_1) => {
                DeviceMatrix::upload(dev, ty, rows, cols, data).map(GpuWeight::Quant)
            }
            _ => StackedExperts::upload(dev, ty, (rows, cols, 1), data).map(GpuWeight::Float),
        }
    };
    match upload {
        Ok(g) => Ok(Some(g)),
        // A shape the kernels do not take (odd widths, partial blocks): not a matrix the graph multiplies
        // by on the card; using it says so.
        Err(CudaError::Invalid(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

impl GpuWeights {
    /// Uploads every matrix of the file but those `skip` names (the expert cache's).
    pub fn upload(
        dev: &Device,
        cpu: &CpuWeights,
        skip: impl Fn(WeightId) -> bool,
    ) -> CudaResult<GpuWeights> {
        let n = cpu.file().n_tensors();
        let mut mats = Vec::with_capacity(n);
        let mut bytes = 0usize;
        for i in 0..n {
            let w = WeightId(i as u32);
            let g = if skip(w) {
                None
            } else {
                upload_one(dev, cpu, w)?
            };
            if g.is_some() {
                bytes += cpu.info(w).n_bytes as usize;
            }
            mats.push(g);
        }
        dev.synchronize()?;
        Ok(GpuWeights {
            mats,
            vectors: Mutex::new(HashMap::new()),
            bytes,
        })
    }

    /// The matrix of `w`, if it is on the card.
    pub fn matrix(&self, w: WeightId) -> CudaResult<&GpuWeight> {
        self.mats
            .get(w.0 as usize)
            .and_then(|m| m.as_ref())
            .ok_or_else(|| {
                CudaError::Invalid(format!("weight {} is not a matrix on the card", w.0))
            })
    }

    /// The tensor of `w` as f32 values (uploaded on first use).
    pub fn vector(
        &self,
        dev: &Device,
        cpu: &CpuWeights,
        w: WeightId,
    ) -> CudaResult<Arc<DeviceBuffer<f32>>> {
        let mut map = self.vectors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = map.get(&w.0) {
            return Ok(v.clone());
        }
        let v = Arc::new(dev.upload(cpu.f32(w))?);
        map.insert(w.0, v.clone());
        Ok(v)
    }

    /// Bytes of the file's matrices on the card.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}
