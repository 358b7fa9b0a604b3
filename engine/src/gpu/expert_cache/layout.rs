//! The routed experts of a file as the cache handles them: per MoE layer the three expert tensors
//! (`blk.N.ffn_{gate,up,down}_exps.weight`, each `[cols, rows, n_expert]`), and where each expert's three
//! matrices lie in a cache slot (gate, up, down back to back; one slot size for all layers, the largest).

use poly_kernels::quant::GgmlType;
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

const ROLES: [&str; 3] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];

/// Parses `blk.N.<role>.weight`.
fn block_and_role(name: &str) -> Option<(u32, usize)> {
    let rest = name.strip_prefix("blk.")?;
    let (n, rest) = rest.split_once('.')?;
    let role = rest.strip_suffix(".weight")?;
    Some((n.parse().ok()?, ROLES.iter().position(|r| *r == role)?))
}

/// The MoE layers of `cpu`'s file whose three expert tensors are all present, 3-D, with the same expert
/// count and a byte size that is whole experts; by block number.
pub fn expert_layers(cpu: &CpuWeights) -> Vec<ExpertLayer> {
    let file = cpu.file();
    let mut found: std::collections::BTreeMap<u32, [Option<(WeightId, usize)>; 3]> =
        Default::default();
    for (i, t) in file.tensor_infos().iter().enumerate() {
        let Some((block, role)) = block_and_role(&t.name) else {
            continue;
        };
        let dims: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        let n_expert = match dims.as_slice() {
            [_, _, e] | [_, _, e, 1] => *e,
            _ => continue,
        };
        found.entry(block).or_default()[role] = Some((WeightId(i as u32), n_expert));
    }
    let mut out = Vec::new();
    for (block, roles) in found {
        let [Some(g), Some(u), Some(d)] = roles else {
            continue;
        };
        let n_expert = g.1;
        if u.1 != n_expert || d.1 != n_expert || n_expert == 0 {
            continue;
        }
        let mut offset = 0;
        let mut mats = Vec::with_capacity(3);
        for (w, _) in [g, u, d] {
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
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(block_and_role("blk.12.ffn_up_exps.weight"), Some((12, 1)));
        assert_eq!(block_and_role("blk.0.ffn_down_exps.weight"), Some((0, 2)));
        assert_eq!(block_and_role("blk.0.ffn_up_shexp.weight"), None);
        assert_eq!(block_and_role("blk.x.ffn_up_exps.weight"), None);
        assert_eq!(block_and_role("output.weight"), None);
    }
}
