//! From coefficients to pixels: the IDCT in stb's SSE2 arithmetic, chroma upsampling, YCbCr (and
//! CMYK, YCCK) to RGB, and the whole picture's conversion (`to_rgb`).

use super::{Decoder, Rgb8};

impl Decoder<'_> {
    pub(super) fn to_rgb(&self) -> Result<Rgb8, String> {
        let (width, height) = (self.width, self.height);
        let img_n = self.comps.len();
        let is_rgb =
            img_n == 3 && (self.rgb == 3 || (self.app14_color_transform == 0 && !self.jfif));
        struct Resample {
            kind: Upsample,
            hs: usize,
            vs: usize,
            ystep: usize,
            ypos: usize,
            w_lores: usize,
            line0: usize,
            line1: usize,
        }
        let mut res: Vec<Resample> = self
            .comps
            .iter()
            .map(|c| {
                let hs = self.h_max / c.h;
                let vs = self.v_max / c.v;
                Resample {
                    kind: match (hs, vs) {
                        (1, 1) => Upsample::None,
                        (1, 2) => Upsample::V2,
                        (2, 1) => Upsample::H2,
                        (2, 2) => Upsample::Hv2,
                        _ => Upsample::Nearest,
                    },
                    hs,
                    vs,
                    ystep: vs >> 1,
                    ypos: 0,
                    w_lores: width.div_ceil(hs),
                    line0: 0,
                    line1: 0,
                }
            })
            .collect();
        let mut lines = vec![vec![0u8; width + 3]; img_n];
        let mut pixels = vec![0u8; width * height * 3];
        for out in pixels.chunks_exact_mut(width * 3) {
            for (k, r) in res.iter_mut().enumerate() {
                let c = &self.comps[k];
                let y_bot = r.ystep >= (r.vs >> 1);
                let (near, far) = if y_bot {
                    (r.line1, r.line0)
                } else {
                    (r.line0, r.line1)
                };
                let w = r.w_lores;
                upsample(
                    r.kind,
                    &mut lines[k],
                    &c.data[near..near + w],
                    &c.data[far..far + w],
                    r.hs,
                );
                r.ystep += 1;
                if r.ystep >= r.vs {
                    r.ystep = 0;
                    r.line0 = r.line1;
                    r.ypos += 1;
                    if r.ypos < c.y {
                        r.line1 += c.w2;
                    }
                }
            }
            let px = out.chunks_exact_mut(3);
            match img_n {
                3 if is_rgb => {
                    for (i, o) in px.enumerate() {
                        o.copy_from_slice(&[lines[0][i], lines[1][i], lines[2][i]]);
                    }
                }
                3 => ycbcr_to_rgb(out, &lines[0], &lines[1], &lines[2]),
                4 if self.app14_color_transform == 0 => {
                    for (i, o) in px.enumerate() {
                        let m = lines[3][i];
                        o.copy_from_slice(&[
                            blinn(lines[0][i], m),
                            blinn(lines[1][i], m),
                            blinn(lines[2][i], m),
                        ]);
                    }
                }
                4 if self.app14_color_transform == 2 => {
                    ycbcr_to_rgb(out, &lines[0], &lines[1], &lines[2]);
                    for (i, o) in out.chunks_exact_mut(3).enumerate() {
                        let m = lines[3][i];
                        for v in o {
                            *v = blinn(255 - *v, m);
                        }
                    }
                }
                4 => ycbcr_to_rgb(out, &lines[0], &lines[1], &lines[2]),
                _ => {
                    for (i, o) in px.enumerate() {
                        o.fill(lines[0][i]);
                    }
                }
            }
        }
        Ok(Rgb8 {
            width,
            height,
            pixels,
        })
    }
}

#[derive(Clone, Copy)]
enum Upsample {
    None,
    V2,
    H2,
    Hv2,
    Nearest,
}

fn div4(x: i32) -> u8 {
    (x >> 2) as u8
}

fn div16(x: i32) -> u8 {
    (x >> 4) as u8
}

/// One output row of a component from its rows `near` and `far` (`w` samples each) into `out`.
fn upsample(kind: Upsample, out: &mut [u8], near: &[u8], far: &[u8], hs: usize) {
    let w = near.len();
    let n = |i: usize| near[i] as i32;
    let f = |i: usize| far[i] as i32;
    match kind {
        Upsample::None => out[..w].copy_from_slice(near),
        Upsample::V2 => {
            for ((o, &a), &b) in out.iter_mut().zip(near).zip(far) {
                *o = div4(3 * a as i32 + b as i32 + 2);
            }
        }
        Upsample::H2 => {
            if w == 1 {
                out[0] = near[0];
                out[1] = near[0];
                return;
            }
            out[0] = near[0];
            out[1] = div4(n(0) * 3 + n(1) + 2);
            let mut i = 1;
            while i < w - 1 {
                let m = 3 * n(i) + 2;
                out[i * 2] = div4(m + n(i - 1));
                out[i * 2 + 1] = div4(m + n(i + 1));
                i += 1;
            }
            out[i * 2] = div4(n(w - 2) * 3 + n(w - 1) + 2);
            out[i * 2 + 1] = near[w - 1];
        }
        Upsample::Hv2 => {
            if w == 1 {
                let v = div4(3 * n(0) + f(0) + 2);
                out[0] = v;
                out[1] = v;
                return;
            }
            let mut t1 = 3 * n(0) + f(0);
            out[0] = div4(t1 + 2);
            for i in 1..w {
                let t0 = t1;
                t1 = 3 * n(i) + f(i);
                out[i * 2 - 1] = div16(3 * t0 + t1 + 8);
                out[i * 2] = div16(3 * t1 + t0 + 8);
            }
            out[w * 2 - 1] = div4(t1 + 2);
        }
        Upsample::Nearest => {
            for i in 0..w {
                out[i * hs..i * hs + hs].fill(near[i]);
            }
        }
    }
}

/// `x·y/255` rounded, as stb computes it.
fn blinn(x: u8, y: u8) -> u8 {
    let t = x as u32 * y as u32 + 128;
    ((t + (t >> 8)) >> 8) as u8
}

/// stb's `float2fixed`: 12 fractional bits (rounded in f32), shifted to 20.
fn float2fixed(x: f32) -> i32 {
    ((x * 4096.0 + 0.5) as i32) << 8
}

/// A row of YCbCr to RGB in stb's fixed point, three bytes a pixel.
fn ycbcr_to_rgb(out: &mut [u8], y: &[u8], cb: &[u8], cr: &[u8]) {
    let (cr_r, cr_g) = (float2fixed(1.40200), -float2fixed(0.71414));
    let (cb_g, cb_b) = (-float2fixed(0.34414), float2fixed(1.77200));
    let clamp = |v: i32| v.clamp(0, 255) as u8;
    for (i, o) in out.chunks_exact_mut(3).enumerate() {
        let y_fixed = ((y[i] as i32) << 20) + (1 << 19);
        let cr = cr[i] as i32 - 128;
        let cb = cb[i] as i32 - 128;
        let r = y_fixed + cr * cr_r;
        let g = y_fixed + cr * cr_g + ((cb * cb_g) & (0xffff_0000u32 as i32));
        let b = y_fixed + cb * cb_b;
        o[0] = clamp(r >> 20);
        o[1] = clamp(g >> 20);
        o[2] = clamp(b >> 20);
    }
}

/// stb's `f2f`: a float constant to 12 fractional bits (the product in f32, the rounding in f64).
pub(super) fn f2f(x: f32) -> i32 {
    ((x * 4096.0) as f64 + 0.5) as i32
}

/// The constant pairs of the SSE2 IDCT's `pmaddwd` rotations.
pub(super) struct IdctConsts {
    rot0: [(i32, i32); 2],
    rot1: [(i32, i32); 2],
    rot2: [(i32, i32); 2],
    rot3: [(i32, i32); 2],
}

// stb's constants as it writes them (f32 literals of jidctint's), so that they round as there.
#[allow(clippy::excessive_precision)]
pub(super) fn idct_consts() -> IdctConsts {
    let s16 = |x: i32| x as i16 as i32;
    let pair = |a: i32, b: i32| (s16(a), s16(b));
    IdctConsts {
        rot0: [
            pair(f2f(0.5411961), f2f(0.5411961) + f2f(-1.847759065)),
            pair(f2f(0.5411961) + f2f(0.765366865), f2f(0.5411961)),
        ],
        rot1: [
            pair(f2f(1.175875602) + f2f(-0.899976223), f2f(1.175875602)),
            pair(f2f(1.175875602), f2f(1.175875602) + f2f(-2.562915447)),
        ],
        rot2: [
            pair(f2f(-1.961570560) + f2f(0.298631336), f2f(-1.961570560)),
            pair(f2f(-1.961570560), f2f(-1.961570560) + f2f(3.072711026)),
        ],
        rot3: [
            pair(f2f(-0.390180644) + f2f(2.053119869), f2f(-0.390180644)),
            pair(f2f(-0.390180644), f2f(-0.390180644) + f2f(1.501321110)),
        ],
    }
}

/// `pmaddwd` of one lane: `x·c.0 + y·c.1` in wrapping 32 bits.
fn madd(x: i16, y: i16, c: (i32, i32)) -> i32 {
    (x as i32 * c.0).wrapping_add(y as i32 * c.1)
}

fn sat16(x: i32) -> i16 {
    x.clamp(i16::MIN as i32, i16::MAX as i32) as i16
}

/// One 1-D pass of the SSE2 IDCT over 8 lanes: `r[row][lane]` in, the same layout out.
fn idct_pass(r: &[[i16; 8]; 8], k: &IdctConsts, bias: i32, shift: u32) -> [[i16; 8]; 8] {
    let mut o = [[0i16; 8]; 8];
    for l in 0..8 {
        let t2e = madd(r[2][l], r[6][l], k.rot0[0]);
        let t3e = madd(r[2][l], r[6][l], k.rot0[1]);
        let t0e = (r[0][l].wrapping_add(r[4][l]) as i32) << 12;
        let t1e = (r[0][l].wrapping_sub(r[4][l]) as i32) << 12;
        let x0 = t0e.wrapping_add(t3e);
        let x3 = t0e.wrapping_sub(t3e);
        let x1 = t1e.wrapping_add(t2e);
        let x2 = t1e.wrapping_sub(t2e);
        let y0o = madd(r[7][l], r[3][l], k.rot2[0]);
        let y2o = madd(r[7][l], r[3][l], k.rot2[1]);
        let y1o = madd(r[5][l], r[1][l], k.rot3[0]);
        let y3o = madd(r[5][l], r[1][l], k.rot3[1]);
        let sum17 = r[1][l].wrapping_add(r[7][l]);
        let sum35 = r[3][l].wrapping_add(r[5][l]);
        let y4o = madd(sum17, sum35, k.rot1[0]);
        let y5o = madd(sum17, sum35, k.rot1[1]);
        let x4 = y0o.wrapping_add(y4o);
        let x5 = y1o.wrapping_add(y5o);
        let x6 = y2o.wrapping_add(y5o);
        let x7 = y3o.wrapping_add(y4o);
        for (a, b, lo, hi) in [
            (x0, x7, 0, 7),
            (x1, x6, 1, 6),
            (x2, x5, 2, 5),
            (x3, x4, 3, 4),
        ] {
            let ab = a.wrapping_add(bias);
            o[lo][l] = sat16(ab.wrapping_add(b) >> shift);
            o[hi][l] = sat16(ab.wrapping_sub(b) >> shift);
        }
    }
    o
}

/// The 8×8 block `data` (dequantized, row-major) to samples at `out[row·stride + col]`, as stb's SSE2
/// IDCT computes them.
pub(super) fn idct_block(out: &mut [u8], stride: usize, data: &[i16; 64], k: &IdctConsts) {
    let mut rows = [[0i16; 8]; 8];
    for (r, row) in rows.iter_mut().enumerate() {
        row.copy_from_slice(&data[r * 8..r * 8 + 8]);
    }
    let cols = idct_pass(&rows, k, 512, 10);
    let mut t = [[0i16; 8]; 8];
    for (r, row) in cols.iter().enumerate() {
        for (c, &v) in row.iter().enumerate() {
            t[c][r] = v;
        }
    }
    let res = idct_pass(&t, k, 65536 + (128 << 17), 17);
    // res[c][r]: the sample at row r, column c.
    for r in 0..8 {
        let line = &mut out[r * stride..r * stride + 8];
        for (c, v) in line.iter_mut().enumerate() {
            *v = res[c][r].clamp(0, 255) as u8;
        }
    }
}
