//! Pictures for the vision encoders: decoding (PNG, JPEG, WebP), the resize llama.cpp's mtmd applies before
//! encoding, and normalization to the floats an encoder reads.
//!
//! The resize is Pillow's separable resampling in 8-bit fixed point (22 fractional bits), the algorithm
//! mtmd's `img_tool` reimplements, so a picture resized here has the same bytes as mtmd's: bilinear,
//! bicubic (`a = −0.5`, as Pillow) or Lanczos-3 filters whose support widens with the downscaling factor.

use image::{ImageReader, Limits};
use std::io::Cursor;

/// The largest side of a picture this decodes: a picture arrives from the network, and a few bytes of
/// header can claim any size. The encoders resize to at most some thousands of pixels a side anyway.
pub const MAX_SIDE: u32 = 16_384;

/// The most memory a picture's decoding may take (a 16,384 × 4,096 RGBA picture).
pub const MAX_DECODE_BYTES: u64 = 256 << 20;

/// An 8-bit RGB picture, row-major, three bytes a pixel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb8 {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

/// A normalized picture: `height` rows of `width` pixels of three f32 channels, interleaved.
#[derive(Clone, Debug, PartialEq)]
pub struct RgbF32 {
    pub width: usize,
    pub height: usize,
    pub values: Vec<f32>,
}

/// The resampling filter of a resize.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
    Lanczos,
}

/// How a picture is fitted to a size of another aspect ratio (mtmd's `pad_style`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Stretched to the size.
    Stretch,
    /// Scaled to fit inside (sides rounded up), centred on black (mtmd's `PAD_CEIL`, its default).
    PadCeil,
}

/// Decodes a PNG, JPEG or WebP picture (recognized by its bytes) to RGB; transparency is dropped, as
/// mtmd's decoder (stb_image asked for three channels) drops it.
///
/// A JPEG (first byte `0xFF`, where PNG and WebP have `0x89` and `R`) is decoded by [`super::jpeg`],
/// byte for byte as mtmd's stb_image decodes it; PNG and WebP by the `image` crate.
pub fn decode(bytes: &[u8]) -> Result<Rgb8, String> {
    if bytes.first() == Some(&0xff) {
        return super::jpeg::decode(bytes).map_err(|e| format!("decoding the JPEG picture: {e}"));
    }
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| format!("reading the picture: {e}"))?;
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(MAX_DECODE_BYTES);
    reader.limits(limits);
    let format = reader.format();
    let img = reader.decode().map_err(|e| match format {
        Some(f) => format!("decoding the {f:?} picture: {e}"),
        None => format!("not a PNG, JPEG or WebP picture: {e}"),
    })?;
    let rgb = img.to_rgb8();
    Ok(Rgb8 {
        width: rgb.width() as usize,
        height: rgb.height() as usize,
        pixels: rgb.into_raw(),
    })
}

/// The size a `width × height` picture is resized to before patching (transformers' `smart_resize`, as
/// mtmd computes it in f32): sides rounded to multiples of `align`, then scaled down (sides floored) when
/// the area exceeds `max_pixels` or up (sides ceiled) when below `min_pixels`, keeping the aspect ratio.
pub fn smart_size(
    (width, height): (usize, usize),
    align: usize,
    (min_pixels, max_pixels): (usize, usize),
) -> (usize, usize) {
    assert!(align > 0, "smart_size: align must be positive");
    if width == 0 || height == 0 {
        return (0, 0);
    }
    let f = align as f32;
    let round_by = |x: f32| (x / f).round() as usize * align;
    let ceil_by = |x: f32| (x / f).ceil() as usize * align;
    let floor_by = |x: f32| (x / f).floor() as usize * align;
    let (w, h) = (width as f32, height as f32);
    let mut w_bar = align.max(round_by(w));
    let mut h_bar = align.max(round_by(h));
    if max_pixels > 0 && h_bar * w_bar > max_pixels {
        let beta = (h * w / max_pixels as f32).sqrt();
        h_bar = align.max(floor_by(h / beta));
        w_bar = align.max(floor_by(w / beta));
    } else if min_pixels > 0 && h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f32 / (h * w)).sqrt();
        h_bar = ceil_by(h * beta);
        w_bar = ceil_by(w * beta);
    }
    (w_bar, h_bar)
}

/// `img` resized to `width × height` with `filter`, fitted as `fit` says.
pub fn resize(img: &Rgb8, (width, height): (usize, usize), filter: Filter, fit: Fit) -> Rgb8 {
    assert!(
        width > 0 && height > 0 && img.width > 0 && img.height > 0,
        "resize: empty picture or size"
    );
    if (width, height) == (img.width, img.height) {
        return img.clone();
    }
    match fit {
        Fit::Stretch => resample(img, (width, height), filter),
        Fit::PadCeil => {
            let scale_w = width as f32 / img.width as f32;
            let scale_h = height as f32 / img.height as f32;
            let scale = scale_w.min(scale_h);
            let inner_w = ((img.width as f32 * scale).ceil() as usize).min(width);
            let inner_h = ((img.height as f32 * scale).ceil() as usize).min(height);
            let inner = resample(img, (inner_w, inner_h), filter);
            let mut out = Rgb8 {
                width,
                height,
                pixels: vec![0; width * height * 3],
            };
            let (ox, oy) = ((width - inner_w) / 2, (height - inner_h) / 2);
            for y in 0..inner_h {
                let src = &inner.pixels[y * inner_w * 3..][..inner_w * 3];
                out.pixels[((oy + y) * width + ox) * 3..][..inner_w * 3].copy_from_slice(src);
            }
            out
        }
    }
}

/// Every byte to `[0, 1]` (`v / 255`), then `(v − mean[c]) / std[c]` per channel, in f32.
pub fn normalize(img: &Rgb8, mean: [f32; 3], std: [f32; 3]) -> RgbF32 {
    let values = img
        .pixels
        .iter()
        .enumerate()
        .map(|(i, &v)| (v as f32 / 255.0 - mean[i % 3]) / std[i % 3])
        .collect();
    RgbF32 {
        width: img.width,
        height: img.height,
        values,
    }
}

/// Fractional bits of the fixed-point weights: 32 bits less 8 for the pixel and 2 of headroom.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The filter's value at distance `x` (in input pixels, after the downscale widening).
fn filter_weight(filter: Filter, x: f64) -> f64 {
    match filter {
        Filter::Lanczos => {
            let sinc = |v: f64| {
                if v == 0.0 {
                    1.0
                } else {
                    let pv = v * std::f64::consts::PI;
                    pv.sin() / pv
                }
            };
            if (-3.0..3.0).contains(&x) {
                sinc(x) * sinc(x / 3.0)
            } else {
                0.0
            }
        }
        Filter::Bilinear => {
            let x = x.abs();
            if x < 1.0 {
                1.0 - x
            } else {
                0.0
            }
        }
        Filter::Bicubic => {
            let (x, a) = (x.abs(), -0.5);
            if x < 1.0 {
                ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
            } else if x < 2.0 {
                (((x - 5.0) * x + 8.0) * x - 4.0) * a
            } else {
                0.0
            }
        }
    }
}

/// One axis' resampling: for each output pixel the first input pixel, the count, and `ksize` fixed-point
/// weights (Pillow's `precompute_coeffs`).
struct AxisWeights {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn axis_weights(in_size: usize, out_size: usize, filter: Filter) -> AxisWeights {
    let support_radius = match filter {
        Filter::Bilinear => 1.0,
        Filter::Bicubic => 2.0,
        Filter::Lanczos => 3.0,
    };
    let scale = in_size as f64 / out_size as f64;
    // Downscaling widens the filter (anti-aliasing); upscaling keeps it.
    let filterscale = scale.max(1.0);
    let support = support_radius * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut row = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // Truncation toward zero, as C's `(int)` conversion.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let count = xmax - xmin;
        let mut total = 0.0;
        row.fill(0.0);
        for (x, w) in row.iter_mut().enumerate().take(count) {
            *w = filter_weight(filter, (x as f64 + xmin as f64 - center + 0.5) * ss);
            total += *w;
        }
        if total != 0.0 {
            row.iter_mut().take(count).for_each(|w| *w /= total);
        }
        let fxp = (1u64 << PRECISION_BITS) as f64;
        for (dst, &w) in weights[xx * ksize..][..ksize].iter_mut().zip(&row) {
            // Pillow adds ±0.5 and truncates, rather than rounding twice.
            *dst = (w * fxp + if w < 0.0 { -0.5 } else { 0.5 }) as i32;
        }
        bounds.push((xmin, count));
    }
    AxisWeights {
        ksize,
        bounds,
        weights,
    }
}

/// A fixed-point accumulator back to a byte: the rounding bias was added at the start.
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

fn resample(img: &Rgb8, (width, height): (usize, usize), filter: Filter) -> Rgb8 {
    let half = 1i32 << (PRECISION_BITS - 1);
    let mut cur = img.clone();
    if width != cur.width {
        let aw = axis_weights(cur.width, width, filter);
        let mut out = vec![0u8; width * cur.height * 3];
        for y in 0..cur.height {
            let src = &cur.pixels[y * cur.width * 3..][..cur.width * 3];
            for (xx, &(xmin, count)) in aw.bounds.iter().enumerate() {
                let k = &aw.weights[xx * aw.ksize..][..count];
                let mut acc = [half; 3];
                for (x, &w) in k.iter().enumerate() {
                    let p = &src[(xmin + x) * 3..][..3];
                    for c in 0..3 {
                        acc[c] += p[c] as i32 * w;
                    }
                }
                for c in 0..3 {
                    out[(y * width + xx) * 3 + c] = clip8(acc[c]);
                }
            }
        }
        cur = Rgb8 {
            width,
            height: cur.height,
            pixels: out,
        };
    }
    if height != cur.height {
        let aw = axis_weights(cur.height, height, filter);
        let row_len = cur.width * 3;
        let mut out = vec![0u8; row_len * height];
        let mut acc = vec![0i32; row_len];
        for (yy, &(ymin, count)) in aw.bounds.iter().enumerate() {
            acc.fill(half);
            for (y, &w) in aw.weights[yy * aw.ksize..][..count].iter().enumerate() {
                let src = &cur.pixels[(ymin + y) * row_len..][..row_len];
                for (a, &p) in acc.iter_mut().zip(src) {
                    *a += p as i32 * w;
                }
            }
            for (o, &a) in out[yy * row_len..][..row_len].iter_mut().zip(&acc) {
                *o = clip8(a);
            }
        }
        cur = Rgb8 {
            width: cur.width,
            height,
            pixels: out,
        };
    }
    cur
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageFormat, RgbImage};

    /// A deterministic 13×9 picture with edges and gradients in every channel.
    fn sample() -> Rgb8 {
        let (w, h) = (13usize, 9usize);
        let mut pixels = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            for x in 0..w {
                pixels.extend([
                    (x * 19) as u8,
                    (y * 27) as u8,
                    ((x * y * 7 + 40) % 256) as u8,
                ]);
            }
        }
        Rgb8 {
            width: w,
            height: h,
            pixels,
        }
    }

    /// A PNG claiming `width × height` RGB pixels whose data is an empty zlib stream.
    fn png_header(width: u32, height: u32) -> Vec<u8> {
        fn crc32(bytes: &[u8]) -> u32 {
            let mut crc = !0u32;
            for &b in bytes {
                crc ^= b as u32;
                for _ in 0..8 {
                    crc = if crc & 1 == 1 {
                        (crc >> 1) ^ 0xEDB8_8320
                    } else {
                        crc >> 1
                    };
                }
            }
            !crc
        }
        let mut ihdr = width.to_be_bytes().to_vec();
        ihdr.extend(height.to_be_bytes());
        ihdr.extend([8, 2, 0, 0, 0]);
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        let empty_zlib = [0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01];
        for (kind, data) in [
            (b"IHDR", &ihdr[..]),
            (b"IDAT", &empty_zlib[..]),
            (b"IEND", &[][..]),
        ] {
            let mut chunk = kind.to_vec();
            chunk.extend(data);
            png.extend((data.len() as u32).to_be_bytes());
            png.extend(&chunk);
            png.extend(crc32(&chunk).to_be_bytes());
        }
        png
    }

    #[test]
    fn a_picture_claiming_a_huge_size_is_refused_without_taking_its_memory() {
        // At a sane size the decoder gets past the header and fails on the missing rows.
        let small = decode(&png_header(64, 48)).expect_err("no picture data");
        assert!(!small.contains("limit"), "{small}");
        for (w, h) in [(100_000, 100_000), (MAX_SIDE + 1, 16), (16_000, 16_000)] {
            let e = decode(&png_header(w, h)).expect_err("a huge picture must be refused");
            assert!(e.contains("limit"), "{w}×{h}: {e}");
        }
    }

    fn encode(img: &Rgb8, format: ImageFormat) -> Vec<u8> {
        let buf = RgbImage::from_raw(img.width as u32, img.height as u32, img.pixels.clone())
            .expect("buffer size");
        let mut out = Cursor::new(Vec::new());
        buf.write_to(&mut out, format).expect("encode");
        out.into_inner()
    }

    #[test]
    fn png_and_webp_decode_exactly_and_another_encoders_jpeg_closely() {
        let img = sample();
        assert_eq!(decode(&encode(&img, ImageFormat::Png)).expect("png"), img);
        // image's WebP encoder writes lossless WebP.
        assert_eq!(decode(&encode(&img, ImageFormat::WebP)).expect("webp"), img);
        let jpeg = decode(&encode(&img, ImageFormat::Jpeg)).expect("jpeg");
        assert_eq!((jpeg.width, jpeg.height), (img.width, img.height));
        let mean_err = jpeg
            .pixels
            .iter()
            .zip(&img.pixels)
            .map(|(&a, &b)| (a as f64 - b as f64).abs())
            .sum::<f64>()
            / img.pixels.len() as f64;
        assert!(mean_err < 12.0, "JPEG mean error {mean_err}");
        assert!(decode(b"GIF89a not a picture").is_err());
    }

    #[test]
    fn smart_size_follows_mtmds_rule() {
        // Qwen-VL: align 32 (patch 16, merge 2), 8 to 4096 tokens of 32×32 pixels.
        let limits = (8 * 1024, 4096 * 1024);
        // 64×48 rounds to 64×64 = 4096 pixels < 8192: scaled up by √(8192/3072), sides ceiled.
        assert_eq!(smart_size((64, 48), 32, limits), (128, 96));
        // In range: each side rounded to the nearest multiple (half away from zero).
        assert_eq!(smart_size((640, 480), 32, limits), (640, 480));
        assert_eq!(smart_size((500, 300), 32, limits), (512, 288));
        assert_eq!(smart_size((16, 300), 32, limits), (32, 288));
        // Too large: scaled down by √(area/max), sides floored.
        assert_eq!(smart_size((4000, 3000), 32, limits), (2336, 1760));
        assert!(2336 * 1760 <= limits.1);
    }

    #[test]
    fn resize_keeps_a_flat_picture_flat_and_the_size_asked() {
        let flat = Rgb8 {
            width: 7,
            height: 5,
            pixels: [10u8, 200, 77].repeat(35),
        };
        for filter in [Filter::Bilinear, Filter::Bicubic, Filter::Lanczos] {
            for size in [(14, 10), (3, 2), (7, 11)] {
                let out = resize(&flat, size, filter, Fit::Stretch);
                assert_eq!((out.width, out.height), size);
                assert!(
                    out.pixels.chunks(3).all(|p| p == [10, 200, 77]),
                    "{filter:?}"
                );
            }
        }
    }

    #[test]
    fn bilinear_doubling_matches_pillows_weights() {
        // 2 → 4 pixels, bilinear: output centres at input 0.25, 0.75, 1.25, 1.75 (scale 0.5), clamped
        // at the edges: weights (1, 0), (0.75, 0.25), (0.25, 0.75), (0, 1) of pixels 0 and 1.
        let img = Rgb8 {
            width: 2,
            height: 1,
            pixels: vec![0, 0, 0, 200, 100, 40],
        };
        let out = resize(&img, (4, 1), Filter::Bilinear, Fit::Stretch);
        assert_eq!(
            out.pixels,
            vec![0, 0, 0, 50, 25, 10, 150, 75, 30, 200, 100, 40]
        );
    }

    #[test]
    fn pad_ceil_centres_the_scaled_picture_on_black() {
        let img = sample(); // 13×9
        let out = resize(&img, (26, 26), Filter::Bicubic, Fit::PadCeil);
        // Scale min(2, 2.89) = 2: 26×18 inside, 4 black rows above and below.
        let inner = resize(&img, (26, 18), Filter::Bicubic, Fit::Stretch);
        assert_eq!(out.pixels[..26 * 4 * 3], vec![0u8; 26 * 4 * 3][..]);
        assert_eq!(out.pixels[26 * 4 * 3..26 * 22 * 3], inner.pixels[..]);
        assert_eq!(out.pixels[26 * 22 * 3..], vec![0u8; 26 * 4 * 3][..]);
    }

    #[test]
    fn normalize_maps_bytes_through_mean_and_std() {
        let img = Rgb8 {
            width: 1,
            height: 1,
            pixels: vec![0, 255, 51],
        };
        let out = normalize(&img, [0.5, 0.5, 0.5], [0.5, 0.25, 2.0]);
        assert_eq!(out.values, vec![-1.0, 2.0, (0.2 - 0.5) / 2.0]);
    }
}
