//! The K-quant batch order (ggml's tiled matmul, [`super::tiled_step`]) sixteen weight rows at a time on
//! AVX-512 VNNI machines: [`KTile`] wraps `x86::ktile_avx512`, whose results equal the row-by-row kernels'
//! bit for bit (tested below against the portable code). It also wraps `x86::legacy_avx512`, the same
//! sixteen-row tile for Q4_0, Q5_0 and Q8_0 in their single-row order.

use super::{KKind, Q2K_TILED, Q3K_TILED, Q4K_TILED, Q5K_TILED, Q6K_TILED, Q8K_BYTES, QK_K};
use crate::quant::iquants::tiled::IqKind;
use crate::quant::legacy::LegacyKind;
use crate::quant::{BatchDot, GgmlType};

#[cfg(target_arch = "x86_64")]
use crate::quant::x86::ktile_avx2 as imp2;
#[cfg(target_arch = "x86_64")]
use crate::quant::x86::ktile_avx512 as imp;
#[cfg(target_arch = "x86_64")]
use crate::quant::x86::legacy_avx512 as legacy_imp;

/// Rows of one tile.
pub const TILE_ROWS: usize = 16;

/// The tile kernel of one format's batch order.
#[derive(Clone, Copy, Debug)]
pub struct KTile {
    /// The K-quant, or `iq` for the IQ formats.
    kind: KKind,
    iq: Option<IqKind>,
    #[cfg(target_arch = "x86_64")]
    order: imp::Order,
    /// The AVX2 kernel (`x86::ktile_avx2`, K-quants) rather than the AVX-512 VNNI one.
    avx2: bool,
    /// A legacy format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in its single-row order, on AVX-512 VNNI
    /// (`x86::legacy_avx512`; Q8_0 or Q8_1 activations, blocks of 32); `kind` and `order` are then not
    /// read.
    legacy: Option<LegacyKind>,
}

/// Sixteen weight rows unpacked for [`KTile::dot`], one tile per super-block; kept between calls to save
/// the allocation.
#[derive(Default)]
pub struct Tiles {
    #[cfg(target_arch = "x86_64")]
    tiles: Vec<imp::Tile>,
    /// A legacy format's blocks ([`KTile`]'s `legacy`).
    #[cfg(target_arch = "x86_64")]
    legacy: Vec<legacy_imp::Block>,
    rows: usize,
}

impl Tiles {
    /// Rows unpacked by the last [`KTile::unpack`].
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The tile kernel for products of `ty` in batch order `order` (`None`: the single-row order) on this
/// machine, with AVX-512 VNNI: Q2_K, Q3_K, Q4_K (its unrepacked order), Q5_K, Q6_K, IQ2_XS, IQ3_XXS and
/// IQ4_XS in their tiled orders, and Q4_K in its repacked orders (single-row and gemm). `--cpu-ktile off` turns
/// it off (the row-by-row kernels then compute the same bits), an A/B switch for its speed.
///
/// With AVX-512 VNNI, the legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) take a tile of their own in
/// their single-row order (`x86::legacy_avx512`).
///
/// Without AVX-512 VNNI but with AVX2 (`--cpu-avx512 off` makes one of this machine), the K-quants take
/// the AVX2 tile kernel (`x86::ktile_avx2`) but for Q4_K, and the IQ formats their row kernels.
pub fn ktile(ty: GgmlType, order: Option<&'static BatchDot>) -> Option<KTile> {
    if !crate::options::get().cpu.ktile {
        return None;
    }
    if crate::quant::has_avx512_vnni() {
        legacy_for(ty, order).or_else(|| ktile_for(ty, order, false))
    } else if crate::quant::has_avx2_fma() {
        // Q4_K keeps its eight-row AVX2 kernel (`rows8`), faster than the tile there (64 tokens of an
        // expert's down product, one thread: 73–79 against 57–60 MAC/ns).
        ktile_for(ty, order, true).filter(|kt| kt.iq.is_none() && kt.kind != KKind::Q4K)
    } else {
        None
    }
}

/// The AVX-512 VNNI tile of a legacy format in its single-row order (the order of its batches too, but
/// for Q4_0's repacked one under `--llama-orders`, which this does not take).
fn legacy_for(ty: GgmlType, order: Option<&'static BatchDot>) -> Option<KTile> {
    #[cfg(target_arch = "x86_64")]
    {
        let kind = match ty {
            GgmlType::Q4_0 => LegacyKind::Q4_0,
            GgmlType::Q4_1 => LegacyKind::Q4_1,
            GgmlType::Q5_0 => LegacyKind::Q5_0,
            GgmlType::Q5_1 => LegacyKind::Q5_1,
            GgmlType::Q8_0 => LegacyKind::Q8_0,
            _ => return None,
        };
        if order.is_some() {
            return None;
        }
        Some(KTile {
            kind: KKind::Q4K,
            iq: None,
            order: imp::Order::Tiled,
            avx2: false,
            legacy: Some(kind),
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, order);
        None
    }
}

/// The tile kernel of `ty` in `order`, AVX2 (`avx2`) or AVX-512 VNNI, whatever this machine has (the
/// caller checks).
fn ktile_for(ty: GgmlType, order: Option<&'static BatchDot>, avx2: bool) -> Option<KTile> {
    #[cfg(target_arch = "x86_64")]
    {
        use imp::Order;
        // Q4_K's repacked orders: the single-row (gemv) one and the gemm's.
        if ty == GgmlType::Q4_K {
            match order {
                None => {
                    return Some(KTile {
                        kind: KKind::Q4K,
                        iq: None,
                        order: Order::Q4kGemv,
                        avx2,
                        legacy: None,
                    })
                }
                Some(o) if std::ptr::eq(o, &super::Q4K_GEMM4) => {
                    return Some(KTile {
                        kind: KKind::Q4K,
                        iq: None,
                        order: Order::Q4kGemm4,
                        avx2,
                        legacy: None,
                    })
                }
                _ => {}
            }
        }
    }
    let order = order?;
    if let Some(iq) = IqKind::of(ty) {
        return crate::quant::iquants::tiled::batch_dot(ty)
            .filter(|o| std::ptr::eq(*o, order))
            .map(|_| KTile {
                kind: KKind::Q4K,
                iq: Some(iq),
                #[cfg(target_arch = "x86_64")]
                order: imp::Order::Tiled,
                avx2,
                legacy: None,
            });
    }
    // The statics are the orders themselves, so their addresses identify them.
    let kind = [
        (&Q2K_TILED, GgmlType::Q2_K, KKind::Q2K),
        (&Q3K_TILED, GgmlType::Q3_K, KKind::Q3K),
        (&Q4K_TILED, GgmlType::Q4_K, KKind::Q4K),
        (&Q5K_TILED, GgmlType::Q5_K, KKind::Q5K),
        (&Q6K_TILED, GgmlType::Q6_K, KKind::Q6K),
    ]
    .into_iter()
    .find(|(o, t, _)| std::ptr::eq(*o, order) && *t == ty)?
    .2;
    Some(KTile {
        kind,
        iq: None,
        #[cfg(target_arch = "x86_64")]
        order: imp::Order::Tiled,
        avx2,
        legacy: None,
    })
}

/// Checks a tile's 1 to 16 `rows` (each at least `bytes` long for `n` values of `what`), records their
/// count in `tiles` and returns their addresses, the last row repeated for the missing ones.
fn tile_rows(
    rows: &[&[u8]],
    (n, bytes): (usize, usize),
    what: &str,
    tiles: &mut Tiles,
) -> [*const u8; TILE_ROWS] {
    assert!(
        (1..=TILE_ROWS).contains(&rows.len()),
        "{} rows in a tile",
        rows.len()
    );
    assert!(
        rows.iter().all(|r| r.len() >= bytes),
        "{what} rows shorter than {n} values"
    );
    tiles.rows = rows.len();
    std::array::from_fn(|i| rows[i.min(rows.len() - 1)].as_ptr())
}

impl KTile {
    /// Most activation rows of one [`KTile::dot`] (its accumulators live on the stack).
    pub const MAX_ACTS: usize = 64;

    /// Fewest activation rows for which a product should take this kernel: below, unpacking sixteen
    /// weight rows costs more than the row-by-row kernels lose (one thread, an expert's products: the
    /// AVX-512 kernel wins from 8; the AVX2 one lost Q6_K at 8, 30 against 41 MAC/ns, and won every
    /// format but Q4_K at 16).
    pub fn min_tokens(&self) -> usize {
        if self.legacy.is_some() {
            // One thread, Q4_0/Q5_0/Q8_0 products against the AVX2 tile of two rows by four: 0.94–1.29×
            // at 8 tokens, 1.11–1.51× at 12, 1.22–1.66× at 16, about 2× at 512.
            12
        } else if self.avx2 {
            16
        } else {
            8
        }
    }

    /// Unpacks `rows` (1 to 16 weight rows of `n` values, whole super-blocks) into `tiles`; missing rows
    /// repeat the last one (their results are for the caller to ignore).
    pub fn unpack(&self, n: usize, rows: &[&[u8]], tiles: &mut Tiles) {
        if let Some(kind) = self.legacy {
            return self.unpack_legacy(kind, n, rows, tiles);
        }
        assert!(n.is_multiple_of(QK_K), "{:?} rows of {n} values", self.kind);
        let nb = n / QK_K;
        let bb = self
            .iq
            .map_or(self.kind.block_bytes(), |iq| iq.block_bytes());
        let what = self
            .iq
            .map_or(format!("{:?}", self.kind), |iq| format!("{iq:?}"));
        let ptrs = tile_rows(rows, (n, nb * bb), &what, tiles);
        #[cfg(target_arch = "x86_64")]
        {
            if self.avx2 {
                assert!(crate::quant::has_avx2_fma(), "AVX2 KTile without AVX2");
                assert!(self.iq.is_none(), "no AVX2 tiles of the IQ formats");
            } else {
                assert!(
                    crate::quant::has_avx512_vnni(),
                    "KTile without AVX-512 VNNI"
                );
            }
            tiles.tiles.resize_with(nb, imp::Tile::zeroed);
            for (b, tile) in tiles.tiles.iter_mut().enumerate() {
                // SAFETY: `has_avx512_vnni` confirmed AVX-512 F/BW/VL/VNNI with AVX2, FMA and F16C, or
                // for the AVX2 kernel `has_avx2_fma` AVX2, FMA and F16C (asserted above); every row
                // holds `nb > b` blocks (asserted).
                unsafe {
                    match self.iq {
                        _ if self.avx2 => imp2::unpack(self.kind, &ptrs, b, tile),
                        Some(iq) => imp::unpack_iq(iq, &ptrs, b, tile),
                        None => imp::unpack(self.kind, &ptrs, b, tile),
                    }
                };
            }
        }
    }

    /// [`KTile::unpack`] of a legacy format (blocks of 32 values).
    fn unpack_legacy(&self, kind: LegacyKind, n: usize, rows: &[&[u8]], tiles: &mut Tiles) {
        const QK: usize = 32;
        assert!(n.is_multiple_of(QK), "{kind:?} rows of {n} values");
        let nb = n / QK;
        let ptrs = tile_rows(
            rows,
            (n, nb * kind.block_bytes()),
            &format!("{kind:?}"),
            tiles,
        );
        #[cfg(target_arch = "x86_64")]
        {
            assert!(
                crate::quant::has_avx512_vnni(),
                "KTile without AVX-512 VNNI"
            );
            tiles.legacy.resize_with(nb, legacy_imp::Block::zeroed);
            for (b, block) in tiles.legacy.iter_mut().enumerate() {
                // SAFETY: `has_avx512_vnni` confirmed AVX-512 F/BW/VL/VNNI with AVX2, FMA and F16C
                // (asserted above); every row holds `nb > b` blocks of `kind` (asserted).
                unsafe { legacy_imp::unpack(kind, &ptrs, b, block) };
            }
        }
    }

    /// `out[t][r]`: the batch-order dot product of row `r` of `tiles` with activation row `acts[t]`
    /// (Q8_K, at least as many values as the rows); `out.len() == acts.len()`, at most
    /// [`KTile::MAX_ACTS`].
    pub fn dot(&self, tiles: &Tiles, acts: &[&[u8]], out: &mut [[f32; TILE_ROWS]]) {
        assert_eq!(out.len(), acts.len(), "one output per activation row");
        assert!(
            acts.len() <= Self::MAX_ACTS,
            "{} activation rows in one tile product",
            acts.len()
        );
        let all: [*const u8; Self::MAX_ACTS] =
            std::array::from_fn(|i| acts.get(i).map_or(std::ptr::null(), |a| a.as_ptr()));
        let ptrs = &all[..acts.len()];
        #[cfg(target_arch = "x86_64")]
        if let Some(kind) = self.legacy {
            let nb = tiles.legacy.len();
            assert!(
                acts.iter().all(|a| a.len() >= nb * kind.act_bytes()),
                "{kind:?} activations shorter than the tiles"
            );
            // SAFETY: legacy tiles exist only where `unpack_legacy` found AVX-512 VNNI; every activation
            // row holds `nb` activation blocks of `kind` (asserted) and `out` one entry per row
            // (asserted).
            unsafe { legacy_imp::dot(kind, &tiles.legacy, ptrs, out) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let nb = tiles.tiles.len();
            assert!(
                acts.iter().all(|a| a.len() >= nb * Q8K_BYTES),
                "Q8_K activations shorter than the tiles"
            );
            // SAFETY: `tiles` exist only where `unpack` found AVX-512 VNNI (AVX2 for the AVX2 kernel);
            // every activation row holds `nb` Q8_K blocks (asserted) and `out` one entry per row.
            unsafe {
                if self.avx2 {
                    imp2::dot(self.kind, self.order, &tiles.tiles, ptrs, out);
                } else {
                    imp::dot(self.kind, self.iq, self.order, &tiles.tiles, ptrs, out);
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (tiles, acts, out);
            unreachable!("KTile exists only on x86-64");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{batch_dot, fill_random, ActType};
    use crate::rng::Rng;

    /// Every row of every tile equals the portable batch-order dot product bit for bit, for row counts
    /// below 16 and activation counts that exercise the 8-, 4- and 1-row steps.
    #[test]
    fn tiles_equal_the_portable_batch_order() {
        let types = [
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        let mut rng = Rng::new(24);
        type Portable = fn(usize, &[u8], &[u8]) -> f32;
        let q4k = &super::super::Q4K_GEMM4;
        let mut cases: Vec<(GgmlType, Option<&'static BatchDot>, Portable)> = vec![
            (
                GgmlType::Q4_K,
                None,
                GgmlType::Q4_K.ops().unwrap().vec_dot_portable,
            ),
            (GgmlType::Q4_K, Some(q4k), q4k.portable),
            (GgmlType::Q4_K, Some(&Q4K_TILED), Q4K_TILED.portable),
        ];
        for ty in [GgmlType::IQ2_XS, GgmlType::IQ3_XXS, GgmlType::IQ4_XS] {
            let order = batch_dot(ty).expect("IQ batch order");
            cases.push((ty, Some(order), order.portable));
        }
        for ty in types {
            if ty != GgmlType::Q4_K {
                let order = batch_dot(ty).expect("K-quants have a batch order");
                cases.push((ty, Some(order), order.portable));
            }
        }
        // Both kernels where this machine has them (the AVX2 one on AVX-512 machines too).
        let kernels = [
            (false, crate::quant::has_avx512_vnni()),
            (true, crate::quant::has_avx2_fma()),
        ];
        let mut tested = 0;
        for ((ty, order, portable), (avx2, here)) in cases
            .iter()
            .flat_map(|c| kernels.iter().map(move |k| (*c, *k)))
        {
            let Some(kt) = ktile_for(ty, order, avx2).filter(|kt| !(avx2 && kt.iq.is_some()))
            else {
                continue;
            };
            if !here {
                eprintln!("{ty} {kt:?}: not this machine's, not tested");
                continue;
            }
            tested += 1;
            for (n, n_rows, n_acts) in [(256, 16, 13), (768, 11, 8), (2048, 5, 3)] {
                let row_bytes = ty.bytes_for(n as u64).unwrap() as usize;
                let mut rows = vec![0u8; n_rows * row_bytes];
                fill_random(ty, &mut rng, 0.05, &mut rows).unwrap();
                let acts: Vec<Vec<u8>> = (0..n_acts)
                    .map(|_| {
                        let x: Vec<f32> = (0..n).map(|_| 3.0 * rng.normal()).collect();
                        let mut a = vec![0u8; ActType::Q8_K.bytes_for(n)];
                        ActType::Q8_K.quantize(&x, &mut a);
                        a
                    })
                    .collect();
                let row_refs: Vec<&[u8]> = rows.chunks_exact(row_bytes).collect();
                let act_refs: Vec<&[u8]> = acts.iter().map(|a| a.as_slice()).collect();
                let mut tiles = Tiles::default();
                kt.unpack(n, &row_refs, &mut tiles);
                let mut out = vec![[0f32; TILE_ROWS]; n_acts];
                kt.dot(&tiles, &act_refs, &mut out);
                for (t, a) in act_refs.iter().enumerate() {
                    for (r, row) in row_refs.iter().enumerate() {
                        let want = portable(n, row, a);
                        assert_eq!(
                            out[t][r].to_bits(),
                            want.to_bits(),
                            "{ty} {kt:?} n {n} row {r} act {t}: {} vs {want}",
                            out[t][r]
                        );
                    }
                }
            }
        }
        // 10 cases × the AVX-512 kernel, the 7 of K-quants × the AVX2 one.
        let want = if crate::quant::has_avx512_vnni() {
            17
        } else {
            7
        };
        if crate::quant::has_avx2_fma() {
            assert_eq!(tested, want, "tile kernels tested");
        }
    }

    /// The legacy formats' tile (on AVX-512 VNNI) equals their single-row kernel and
    /// the portable code bit for bit: partial tiles, odd activation counts (the lone last row), one
    /// block and many, scales that cover f16's range.
    #[test]
    fn legacy_tiles_equal_the_single_row_order() {
        if !crate::quant::has_avx512_vnni() {
            eprintln!("no AVX-512 VNNI: the legacy tile is not this machine's, not tested");
            return;
        }
        let mut rng = Rng::new(32);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
        ] {
            let kt = ktile(ty, None).expect("a legacy tile on AVX-512 VNNI");
            assert!(ktile(ty, Some(&super::super::Q4K_GEMM4)).is_none());
            let ops = ty.ops().unwrap();
            for (n, n_rows, n_acts) in [(32, 16, 1), (640, 16, 9), (2048, 7, 4), (96, 1, 64)] {
                let row_bytes = ty.bytes_for(n as u64).unwrap() as usize;
                let mut rows = vec![0u8; n_rows * row_bytes];
                fill_random(ty, &mut rng, 0.05, &mut rows).unwrap();
                let acts: Vec<Vec<u8>> = (0..n_acts)
                    .map(|_| {
                        let x: Vec<f32> = (0..n).map(|_| 3.0 * rng.normal()).collect();
                        let mut a = vec![0u8; ops.act.bytes_for(n)];
                        ops.act.quantize(&x, &mut a);
                        a
                    })
                    .collect();
                let row_refs: Vec<&[u8]> = rows.chunks_exact(row_bytes).collect();
                let act_refs: Vec<&[u8]> = acts.iter().map(|a| a.as_slice()).collect();
                let mut tiles = Tiles::default();
                kt.unpack(n, &row_refs, &mut tiles);
                assert_eq!(tiles.rows(), n_rows);
                let mut out = vec![[0f32; TILE_ROWS]; n_acts];
                kt.dot(&tiles, &act_refs, &mut out);
                for (t, a) in act_refs.iter().enumerate() {
                    for (r, row) in row_refs.iter().enumerate() {
                        let want = (ops.vec_dot)(n, row, a);
                        let portable = (ops.vec_dot_portable)(n, row, a);
                        assert_eq!(want.to_bits(), portable.to_bits(), "{ty} kernels disagree");
                        assert_eq!(
                            out[t][r].to_bits(),
                            want.to_bits(),
                            "{ty} n {n} row {r} act {t}: {} vs {want}",
                            out[t][r]
                        );
                    }
                }
            }
        }
    }
}
