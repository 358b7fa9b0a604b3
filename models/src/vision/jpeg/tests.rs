//! The JPEG decoder's tests: the bytes stb_image gives on the fixtures, the IDCT lanes against the
//! scalar IDCT, and hostile input.

use super::pixels::f2f;
use super::*;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision/jpeg")
}

fn stb_lines() -> Vec<Vec<String>> {
    let list = std::fs::read_to_string(fixtures().join("stb.txt")).expect("stb.txt");
    list.lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// The fixtures stb decoded: (name, width, height).
fn witnessed() -> Vec<(String, usize, usize)> {
    stb_lines()
        .into_iter()
        .filter(|f| f.len() == 3)
        .map(|f| (f[0].clone(), f[1].parse().unwrap(), f[2].parse().unwrap()))
        .collect()
}

#[test]
fn what_stb_refuses_is_refused() {
    let refused: Vec<String> = stb_lines()
        .into_iter()
        .filter(|f| f.len() == 2 && f[1] == "refused")
        .map(|f| f[0].clone())
        .collect();
    // The arithmetic-coded fixture (cjpeg -arithmetic): stb reads Huffman-coded JPEGs only.
    assert!(!refused.is_empty(), "the witness refused nothing");
    for name in refused {
        assert!(decode(&fixture(&name)).is_err(), "{name} decoded");
    }
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join(format!("{name}.jpg"))).expect("fixture")
}

#[test]
fn every_fixture_decodes_to_stb_images_bytes() {
    let list = witnessed();
    assert!(
        list.len() >= 15,
        "the witness lists {} fixtures",
        list.len()
    );
    for (name, w, h) in list {
        let want = std::fs::read(fixtures().join(format!("{name}.rgb"))).expect("rgb");
        assert_eq!(want.len(), w * h * 3, "{name}: reference size");
        let got = decode(&fixture(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((got.width, got.height), (w, h), "{name}: size");
        if got.pixels != want {
            let at = got
                .pixels
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap();
            let diff = got.pixels.iter().zip(&want).filter(|(a, b)| a != b).count();
            panic!(
                "{name}: {diff} of {} bytes differ from stb's, first at pixel ({}, {}) channel {}: {} against {}",
                want.len(),
                at / 3 % w,
                at / 3 / w,
                at % 3,
                got.pixels[at],
                want[at]
            );
        }
    }
}

#[test]
fn picture_decode_routes_jpeg_here() {
    let (name, w, h) = witnessed()
        .into_iter()
        .find(|(n, ..)| n == "odd-420")
        .expect("odd-420");
    let want = std::fs::read(fixtures().join(format!("{name}.rgb"))).expect("rgb");
    let got = super::super::picture::decode(&fixture(&name)).expect("decode");
    assert_eq!((got.width, got.height, got.pixels), (w, h, want));
}

#[test]
#[allow(clippy::excessive_precision)]
fn the_sse2_idct_lanes_equal_the_scalar_islow_idct_on_ordinary_blocks() {
    // The scalar form (jidctint's, as stb's `stbi__idct_block` writes it) in plain i32, against the
    // lane emulation: equal wherever no 16-bit sum wraps and the column pass fits 16 bits (with
    // coefficients of thousands over a whole block it does not, and the lanes saturate).
    fn scalar(data: &[i16; 64]) -> [u8; 64] {
        let c = |x: f32| f2f(x);
        let idct = |s: [i32; 8]| {
            let p1 = (s[2] + s[6]) * c(0.5411961);
            let t2 = p1 + s[6] * c(-1.847759065);
            let t3 = p1 + s[2] * c(0.765366865);
            let t0 = (s[0] + s[4]) * 4096;
            let t1 = (s[0] - s[4]) * 4096;
            let (x0, x3, x1, x2) = (t0 + t3, t0 - t3, t1 + t2, t1 - t2);
            let (mut t0, mut t1, mut t2, mut t3) = (s[7], s[5], s[3], s[1]);
            let (p3, p4, p1, p2) = (t0 + t2, t1 + t3, t0 + t3, t1 + t2);
            let p5 = (p3 + p4) * c(1.175875602);
            t0 *= c(0.298631336);
            t1 *= c(2.053119869);
            t2 *= c(3.072711026);
            t3 *= c(1.501321110);
            let p1 = p5 + p1 * c(-0.899976223);
            let p2 = p5 + p2 * c(-2.562915447);
            let p3 = p3 * c(-1.961570560);
            let p4 = p4 * c(-0.390180644);
            t3 += p1 + p4;
            t2 += p2 + p3;
            t1 += p2 + p4;
            t0 += p1 + p3;
            [x0, x1, x2, x3, t0, t1, t2, t3]
        };
        let mut v = [0i32; 64];
        for col in 0..8 {
            let s: [i32; 8] = std::array::from_fn(|r| data[r * 8 + col] as i32);
            let [x0, x1, x2, x3, t0, t1, t2, t3] = idct(s);
            let o = [
                x0 + t3,
                x1 + t2,
                x2 + t1,
                x3 + t0,
                x3 - t0,
                x2 - t1,
                x1 - t2,
                x0 - t3,
            ];
            for r in 0..8 {
                v[r * 8 + col] = (o[r] + 512) >> 10;
            }
        }
        let mut out = [0u8; 64];
        for r in 0..8 {
            let s: [i32; 8] = std::array::from_fn(|c| v[r * 8 + c]);
            let [x0, x1, x2, x3, t0, t1, t2, t3] = idct(s);
            let o = [
                x0 + t3,
                x1 + t2,
                x2 + t1,
                x3 + t0,
                x3 - t0,
                x2 - t1,
                x1 - t2,
                x0 - t3,
            ];
            for c in 0..8 {
                out[r * 8 + c] = ((o[c] + 65536 + (128 << 17)) >> 17).clamp(0, 255) as u8;
            }
        }
        out
    }
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let k = idct_consts();
    for round in 0..2000 {
        let scale = [8, 64, 256, 512][round % 4];
        let data: [i16; 64] = std::array::from_fn(|i| {
            let keep = i == 0 || next() % (1 + i as u64 / 4) == 0;
            if keep {
                (next() % (2 * scale + 1)) as i16 - scale as i16
            } else {
                0
            }
        });
        let mut lanes = [0u8; 64];
        idct_block(&mut lanes, 8, &data, &k);
        assert_eq!(lanes, scalar(&data), "block {data:?}");
    }
}

#[test]
fn damaged_jpegs_give_errors_or_pictures_never_panics() {
    for (name, ..) in witnessed() {
        let good = fixture(&name);
        // Every prefix (every fourth for speed), then bytes flipped along the file.
        for len in (0..good.len()).step_by(4) {
            let _ = decode(&good[..len]);
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ good.len() as u64;
        for _ in 0..200 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut bad = good.clone();
            let at = (seed >> 33) as usize % bad.len();
            bad[at] ^= (seed >> 8) as u8 | 1;
            if let Ok(p) = decode(&bad) {
                assert_eq!(p.pixels.len(), p.width * p.height * 3, "{name}");
            }
        }
    }
    // A header and tables but no scan: no picture (stb hands back unwritten memory).
    let name = &witnessed()[0].0;
    let good = fixture(name);
    let sos = good
        .windows(2)
        .position(|w| w == [0xff, 0xda])
        .expect("a scan");
    let e = decode(&good[..sos]).unwrap_err();
    assert!(e.contains("no image data"), "{e}");
    assert!(decode(b"").is_err());
    assert!(decode(&[0xff, 0xd8]).is_err());
    assert!(decode(b"\xff\xd8\xff\xd9").is_err());
}

/// A baseline frame header claiming `width × height`, three components.
fn header(width: u16, height: u16) -> Vec<u8> {
    let mut b = vec![0xff, 0xd8, 0xff, 0xc0, 0, 17, 8];
    b.extend_from_slice(&height.to_be_bytes());
    b.extend_from_slice(&width.to_be_bytes());
    b.push(3);
    for id in 1..=3 {
        b.extend_from_slice(&[id, 0x11, 0]);
    }
    b
}

#[test]
fn a_header_claiming_a_huge_picture_is_refused_before_any_buffer() {
    let e = decode(&header(16_385, 8)).unwrap_err();
    assert!(e.contains("more than 16384"), "{e}");
    // 16,384 × 16,384 × 3 components: within the sides, past the memory bound.
    let e = decode(&header(16_384, 16_384)).unwrap_err();
    assert!(e.contains(&MAX_DECODE_BYTES.to_string()), "{e}");
}

#[test]
fn scans_repeated_past_the_pictures_size_are_refused() {
    // No Huffman tables (stb reads them as all-zero tables: every block decodes from no bits), and
    // the same scan over and over: each costs a whole picture of blocks for 10 bytes.
    let scan = [0xff, 0xda, 0, 12, 3, 1, 0, 2, 0, 3, 0, 0, 63, 0];
    let repeated = |mut b: Vec<u8>, scan: &[u8], n: u64| {
        for _ in 0..n {
            b.extend_from_slice(scan);
        }
        b.extend_from_slice(&[0xff, 0xd9]);
        decode(&b)
    };
    let within = repeated(header(256, 256), &scan, BASELINE_SCAN_FACTOR);
    assert!(within.is_ok(), "{within:?}");
    let e = repeated(header(256, 256), &scan, BASELINE_SCAN_FACTOR + 1).unwrap_err();
    assert!(e.contains("more scan data"), "{e}");
    // Progressive: the interleaved DC scan, many times more.
    let mut progressive = header(256, 256);
    progressive[3] = 0xc2;
    let dc = [0xff, 0xda, 0, 12, 3, 1, 0, 2, 0, 3, 0, 0, 0, 0];
    let within = repeated(progressive.clone(), &dc, PROGRESSIVE_SCAN_FACTOR);
    assert!(within.is_ok(), "{within:?}");
    let e = repeated(progressive, &dc, PROGRESSIVE_SCAN_FACTOR + 1).unwrap_err();
    assert!(e.contains("more scan data"), "{e}");
    // One such scan is a (grey) picture, as stb makes it.
    let mut one = header(16, 16);
    one.extend_from_slice(&scan);
    one.extend_from_slice(&[0xff, 0xd9]);
    let p = decode(&one).expect("one scan");
    assert!(p.pixels.iter().all(|&v| v == p.pixels[0]), "a flat picture");
}
