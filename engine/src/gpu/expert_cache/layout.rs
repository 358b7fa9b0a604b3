//! The routed experts of a file as the cache handles them: per MoE layer the three expert tensors its
//! architecture's tensor table binds (gate, up, down, each `[cols, rows, n_expert]`), and where each expert's three
//! matrices lie in a cache slot (gate, up, down back to back; one slot size for all layers, the largest).

use poly_kernels::quant::GgmlType;
use poly_models::arch::{routed_experts, ArchError};
use poly_models::compute::WeightId;

use crate::cpu::CpuWeights;

/// One expert matrix of a tensor: its format and shape, and its offset in a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertMatrix {
    pub weight: WeightId,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of one expert's matrix.
    pub bytes: usize,
    /// Where it starts in a slot.
    pub offset: usize,
}

/// A MoE layer's routed experts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayer {
    /// The file's block number.
    pub block: u32,
    pub n_expert: usize,
    /// Gate, up, down.
    pub mats: [ExpertMatrix; 3],
}

impl ExpertLayer {
    /// Bytes of one expert's three matrices.
    pub fn expert_bytes(&self) -> usize {
        self.mats.iter().map(|m| m.bytes).sum()
    }

    /// Whether `w` is one of its tensors.
    pub fn has(&self, w: WeightId) -> bool {
        self.mats.iter().any(|m| m.weight == w)
    }
}

/// The MoE layers of `cpu`'s file, as its architecture's tensor table binds their expert tensors
/// ([`poly_models::arch::routed_experts`]), whose three tensors are 3-D with one expert count and a byte
/// size of whole experts; by block number.
pub fn expert_layers(cpu: &CpuWeights) -> Result<Vec<ExpertLayer>, ArchError> {
    let experts_of = |w: WeightId| -> Option<usize> {
        match cpu.info(w).dims.as_slice() {
            [_, _, e] | [_, _, e, 1] => Some(*e as usize),
            _ => None,
        }
    };
    let mut out = Vec::new();
    for routed in routed_experts(cpu.file())? {
        let (g, u, d) = (routed.gate, routed.up, routed.down);
        let (Some(n_expert), Some(nu), Some(nd)) = (experts_of(g), experts_of(u), experts_of(d))
        else {
            continue;
        };
        if nu != n_expert || nd != n_expert || n_expert == 0 {
            continue;
        }
        let block = routed.block;
        let mut offset = 0;
        let mut mats = Vec::with_capacity(3);
        for w in [g, u, d] {
            let info = cpu.info(w);
            let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
            let total = info.n_bytes as usize;
            if !total.is_multiple_of(n_expert) {
                break;
            }
            let bytes = total / n_expert;
            mats.push(ExpertMatrix {
                weight: w,
                ty: info.ty,
                rows,
                cols,
                bytes,
                offset,
            });
            // Keep every matrix 256-byte aligned in its slot (the kernels read 4-byte words at least).
            offset += bytes.div_ceil(256) * 256;
        }
        if let Ok(mats) = <[ExpertMatrix; 3]>::try_from(mats) {
            out.push(ExpertLayer {
                block,
                n_expert,
                mats,
            });
        }
    }
    Ok(out)
}

/// Bytes of a slot that holds any layer's expert (the largest layer's, aligned as laid out).
pub fn slot_bytes(layers: &[ExpertLayer]) -> usize {
    layers
        .iter()
        .map(|l| {
            let last = &l.mats[2];
            (last.offset + last.bytes).div_ceil(256) * 256
        })
        .max()
        .unwrap_or(0)
}
