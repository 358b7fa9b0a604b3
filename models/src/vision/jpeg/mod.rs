//! JPEG decoding with the same bytes as llama.cpp's mtmd: `mtmd-helper.cpp` decodes pictures with
//! stb_image 2.30 (`stbi_load_from_memory(…, 3)`), compiled for x86-64, where `STBI_SSE2` is on.
//!
//! What that build runs, and so what this follows:
//! - The IDCT is stb's SSE2 one (`stbi__idct_simd`): jidctint's integer "islow" IDCT with 12-bit
//!   constants, computed as the SSE2 lanes compute it — sums of two coefficients in 16 bits
//!   (wrapping), products summed in 32 bits, the column pass's results saturated to 16 bits, the row
//!   pass's saturated to 0..=255. On real files it equals stb's scalar IDCT (its comment says so); on
//!   extreme coefficients the lanes' 16-bit sums decide, and this follows the lanes.
//! - Colour: three channels are asked, so the SSE2 YCbCr kernel (written for four) falls through to its
//!   scalar loop: `y·2²⁰ + 2¹⁹` plus chroma times 12-bit constants shifted by 8, the green Cb term masked
//!   to its high 16 bits, `>> 20`, clamped.
//! - Chroma upsampling: h2v2 "fancy" (3:1 triangle both ways, `(3·a + b + 8) >> 4`; the SSE2 kernel gives
//!   the scalar one's bytes), h2v1 and h1v2 triangles, nearest for other ratios; rows picked by stb's
//!   near/far row walk.
//! - The bit reader: 9-bit fast Huffman tables, the fast AC table, zeros fed after a marker or the end of
//!   the data, a restart marker expected where the interval says (else the scan ends: corrupt data
//!   rather than none), an unknown marker between scans ending the picture as it stands.
//! - Where stb hands back memory it never wrote (no scan at all, blocks after a missing restart marker,
//!   a progressive picture cut before its end), this refuses (no scan) or gives zeros' colour and
//!   finishes the coefficients it has: stb's bytes there are whatever its heap held.
//! - Baseline and progressive (spectral selection, successive approximation, EOB runs), 1, 3 or 4
//!   components (Adobe CMYK and YCCK as stb converts them; RGB by component ids or Adobe transform 0).
//!
//! Written from the JPEG standard and stb_image's documented behaviour; the witness
//! (`tests/witness/jpeg_stb_witness.sh`) compiles stb_image as mtmd does and writes the bytes the tests
//! compare with. Hostile input gets an error: sides up to [`MAX_SIDE`], buffers up to
//! [`MAX_DECODE_BYTES`], and a bound on the blocks all scans together may decode.

mod entropy;
mod pixels;
#[cfg(test)]
mod tests;

use super::picture::{Rgb8, MAX_DECODE_BYTES, MAX_SIDE};
use entropy::{Bits, Huffman, Source};
use pixels::{idct_block, idct_consts, IdctConsts};

const FAST_BITS: u32 = 9;
const FAST_SIZE: usize = 1 << FAST_BITS;
const MARKER_NONE: u8 = 0xff;

/// How many blocks all scans together may decode, as a multiple of the frame's blocks. A baseline
/// picture decodes each block once (one scan, or one scan a component); a progressive one visits each
/// block once a scan, a scan of one component only its blocks: libjpeg's ten-scan script visits fewer
/// than six times the frame's blocks, and encoders that search scan scripts (mozjpeg) write more scans,
/// so the progressive bound is wide. A visit costs at most one block's decoding (and a baseline one an
/// IDCT), so the bound keeps a few bytes of scan headers repeated from costing minutes.
const BASELINE_SCAN_FACTOR: u64 = 4;
const PROGRESSIVE_SCAN_FACTOR: u64 = 64;

/// Zigzag position → row-major position, with 15 extra entries so that a corrupt run past the end
/// lands on the last coefficient.
const DEZIGZAG: [usize; 79] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20,
    13, 6, 7, 14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59,
    52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63,
    63, 63, 63, 63, 63,
];

/// Decodes a JPEG to RGB as stb_image (asked for three channels) decodes it.
pub fn decode(bytes: &[u8]) -> Result<Rgb8, String> {
    let mut d = Decoder::new(bytes);
    d.decode_image()?;
    d.to_rgb()
}

#[derive(Clone, Default)]
struct Component {
    id: u8,
    h: usize,
    v: usize,
    tq: usize,
    hd: usize,
    ha: usize,
    dc_pred: i32,
    x: usize,
    y: usize,
    w2: usize,
    h2: usize,
    data: Vec<u8>,
    coeff: Vec<i16>,
    coeff_w: usize,
}

struct Decoder<'a> {
    bits: Bits<'a>,
    huff_dc: Vec<Huffman>,
    huff_ac: Vec<Huffman>,
    fast_ac: Vec<[i16; FAST_SIZE]>,
    dequant: [[u16; 64]; 4],
    comps: Vec<Component>,
    width: usize,
    height: usize,
    h_max: usize,
    v_max: usize,
    mcu_x: usize,
    mcu_y: usize,
    progressive: bool,
    spec_start: usize,
    spec_end: usize,
    succ_high: i32,
    succ_low: i32,
    eob_run: i32,
    jfif: bool,
    app14_color_transform: i32,
    rgb: usize,
    scan_n: usize,
    order: [usize; 4],
    restart_interval: i32,
    todo: i32,
    blocks_left: u64,
    idct: IdctConsts,
}

fn is_restart(m: u8) -> bool {
    (0xd0..=0xd7).contains(&m)
}

fn corrupt(what: &str) -> String {
    format!("corrupt JPEG: {what}")
}

impl<'a> Decoder<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Decoder {
            bits: Bits {
                s: Source { buf: bytes, pos: 0 },
                code_buffer: 0,
                code_bits: 0,
                marker: MARKER_NONE,
                nomore: false,
            },
            huff_dc: vec![Huffman::default(); 4],
            huff_ac: vec![Huffman::default(); 4],
            fast_ac: vec![[0; FAST_SIZE]; 4],
            dequant: [[0; 64]; 4],
            comps: Vec::new(),
            width: 0,
            height: 0,
            h_max: 1,
            v_max: 1,
            mcu_x: 0,
            mcu_y: 0,
            progressive: false,
            spec_start: 0,
            spec_end: 0,
            succ_high: 0,
            succ_low: 0,
            eob_run: 0,
            jfif: false,
            app14_color_transform: -1,
            rgb: 0,
            scan_n: 0,
            order: [0; 4],
            restart_interval: 0,
            todo: 0,
            blocks_left: 0,
            idct: idct_consts(),
        }
    }

    fn s(&mut self) -> &mut Source<'a> {
        &mut self.bits.s
    }

    fn reset(&mut self) {
        self.bits.code_bits = 0;
        self.bits.code_buffer = 0;
        self.bits.nomore = false;
        for c in &mut self.comps {
            c.dc_pred = 0;
        }
        self.bits.marker = MARKER_NONE;
        self.todo = if self.restart_interval != 0 {
            self.restart_interval
        } else {
            0x7fff_ffff
        };
        self.eob_run = 0;
    }

    /// Spends one block of the budget all scans share.
    fn spend_block(&mut self) -> Result<(), String> {
        if self.blocks_left == 0 {
            return Err("JPEG: more scan data than a picture of its size needs (refused)".into());
        }
        self.blocks_left -= 1;
        Ok(())
    }

    /// Counts an MCU down the restart interval: `Ok(false)` ends the scan (no restart marker where
    /// one belongs).
    fn count_restart(&mut self) -> bool {
        self.todo -= 1;
        if self.todo <= 0 {
            if self.bits.code_bits < 24 {
                self.bits.grow();
            }
            if !is_restart(self.bits.marker) {
                return false;
            }
            self.reset();
        }
        true
    }

    fn process_marker(&mut self, m: u8) -> Result<(), String> {
        match m {
            MARKER_NONE => return Err(corrupt("expected a marker")),
            0xdd => {
                if self.s().get16be() != 4 {
                    return Err(corrupt("bad DRI length"));
                }
                self.restart_interval = self.s().get16be();
                return Ok(());
            }
            0xdb => {
                let mut l = self.s().get16be() - 2;
                while l > 0 {
                    let q = self.s().get8();
                    let p = q >> 4;
                    let t = (q & 15) as usize;
                    if p > 1 {
                        return Err(corrupt("bad DQT type"));
                    }
                    if t > 3 {
                        return Err(corrupt("bad DQT table"));
                    }
                    for &z in &DEZIGZAG[..64] {
                        let v = if p != 0 {
                            self.s().get16be() as u16
                        } else {
                            self.s().get8() as u16
                        };
                        self.dequant[t][z] = v;
                    }
                    l -= if p != 0 { 129 } else { 65 };
                }
                return if l == 0 {
                    Ok(())
                } else {
                    Err(corrupt("bad DQT length"))
                };
            }
            0xc4 => {
                let mut l = self.s().get16be() - 2;
                while l > 0 {
                    let q = self.s().get8();
                    let tc = (q >> 4) as usize;
                    let th = (q & 15) as usize;
                    if tc > 1 || th > 3 {
                        return Err(corrupt("bad DHT header"));
                    }
                    let mut sizes = [0usize; 16];
                    let mut n = 0;
                    for s in &mut sizes {
                        *s = self.bits.s.get8() as usize;
                        n += *s;
                    }
                    if n > 256 {
                        return Err(corrupt("bad DHT header"));
                    }
                    l -= 17;
                    let table = if tc == 0 {
                        &mut self.huff_dc[th]
                    } else {
                        &mut self.huff_ac[th]
                    };
                    table.build(&sizes)?;
                    for i in 0..n {
                        table.values[i] = self.bits.s.get8();
                    }
                    if tc != 0 {
                        self.fast_ac[th] = self.huff_ac[th].fast_ac();
                    }
                    l -= n as i32;
                }
                return if l == 0 {
                    Ok(())
                } else {
                    Err(corrupt("bad DHT length"))
                };
            }
            _ => {}
        }
        if (0xe0..=0xef).contains(&m) || m == 0xfe {
            let mut l = self.s().get16be();
            if l < 2 {
                return Err(corrupt(if m == 0xfe {
                    "bad COM length"
                } else {
                    "bad APP length"
                }));
            }
            l -= 2;
            if m == 0xe0 && l >= 5 {
                let mut ok = true;
                for &t in b"JFIF\0" {
                    if self.s().get8() != t {
                        ok = false;
                    }
                }
                l -= 5;
                if ok {
                    self.jfif = true;
                }
            } else if m == 0xee && l >= 12 {
                let mut ok = true;
                for &t in b"Adobe\0" {
                    if self.s().get8() != t {
                        ok = false;
                    }
                }
                l -= 6;
                if ok {
                    self.s().get8();
                    self.s().get16be();
                    self.s().get16be();
                    self.app14_color_transform = self.s().get8() as i32;
                    l -= 6;
                }
            }
            if l != 0 {
                self.s().skip(l);
            }
            return Ok(());
        }
        Err(corrupt(&format!("unknown marker {m:#04x}")))
    }

    fn process_scan_header(&mut self) -> Result<(), String> {
        let ls = self.s().get16be();
        self.scan_n = self.s().get8() as usize;
        if self.scan_n < 1 || self.scan_n > 4 || self.scan_n > self.comps.len() {
            return Err(corrupt("bad SOS component count"));
        }
        if ls != 6 + 2 * self.scan_n as i32 {
            return Err(corrupt("bad SOS length"));
        }
        for i in 0..self.scan_n {
            let id = self.s().get8();
            let q = self.s().get8() as usize;
            let which = self
                .comps
                .iter()
                .position(|c| c.id == id)
                .ok_or_else(|| corrupt("SOS names no component of the frame"))?;
            self.comps[which].hd = q >> 4;
            if self.comps[which].hd > 3 {
                return Err(corrupt("bad DC Huffman table"));
            }
            self.comps[which].ha = q & 15;
            if self.comps[which].ha > 3 {
                return Err(corrupt("bad AC Huffman table"));
            }
            self.order[i] = which;
        }
        self.spec_start = self.s().get8() as usize;
        self.spec_end = self.s().get8() as usize;
        let aa = self.s().get8() as i32;
        self.succ_high = aa >> 4;
        self.succ_low = aa & 15;
        if self.progressive {
            if self.spec_start > 63
                || self.spec_end > 63
                || self.spec_start > self.spec_end
                || self.succ_high > 13
                || self.succ_low > 13
            {
                return Err(corrupt("bad SOS"));
            }
        } else {
            if self.spec_start != 0 || self.succ_high != 0 || self.succ_low != 0 {
                return Err(corrupt("bad SOS"));
            }
            self.spec_end = 63;
        }
        Ok(())
    }

    fn process_frame_header(&mut self) -> Result<(), String> {
        let lf = self.s().get16be();
        if lf < 11 {
            return Err(corrupt("bad SOF length"));
        }
        if self.s().get8() != 8 {
            return Err("JPEG: only 8-bit samples are supported".into());
        }
        self.height = self.s().get16be() as usize;
        if self.height == 0 {
            return Err("JPEG: no height in the header (not supported)".into());
        }
        self.width = self.s().get16be() as usize;
        if self.width == 0 {
            return Err(corrupt("0 width"));
        }
        if self.width > MAX_SIDE as usize || self.height > MAX_SIDE as usize {
            return Err(format!(
                "the picture is {}×{}: more than {MAX_SIDE} pixels a side",
                self.width, self.height
            ));
        }
        let c = self.s().get8() as usize;
        if c != 3 && c != 1 && c != 4 {
            return Err(corrupt("bad component count"));
        }
        if lf != 8 + 3 * c as i32 {
            return Err(corrupt("bad SOF length"));
        }
        self.rgb = 0;
        self.comps = vec![Component::default(); c];
        for i in 0..c {
            let id = self.s().get8();
            self.comps[i].id = id;
            if c == 3 && id == b"RGB"[i] {
                self.rgb += 1;
            }
            let q = self.s().get8() as usize;
            self.comps[i].h = q >> 4;
            if self.comps[i].h == 0 || self.comps[i].h > 4 {
                return Err(corrupt("bad H"));
            }
            self.comps[i].v = q & 15;
            if self.comps[i].v == 0 || self.comps[i].v > 4 {
                return Err(corrupt("bad V"));
            }
            self.comps[i].tq = self.s().get8() as usize;
            if self.comps[i].tq > 3 {
                return Err(corrupt("bad TQ"));
            }
        }
        self.h_max = self.comps.iter().map(|c| c.h).max().unwrap_or(1);
        self.v_max = self.comps.iter().map(|c| c.v).max().unwrap_or(1);
        if self.comps.iter().any(|c| !self.h_max.is_multiple_of(c.h)) {
            return Err(corrupt("bad H"));
        }
        if self.comps.iter().any(|c| !self.v_max.is_multiple_of(c.v)) {
            return Err(corrupt("bad V"));
        }
        self.mcu_x = self.width.div_ceil(self.h_max * 8);
        self.mcu_y = self.height.div_ceil(self.v_max * 8);
        // Every buffer before one is taken: the components' samples (and coefficients when progressive),
        // the output and its line buffers.
        let mut total = (self.width * self.height * 3) as u64 + 4 * (self.width as u64 + 3);
        let mut blocks = 0u64;
        for comp in &mut self.comps {
            comp.x = (self.width * comp.h).div_ceil(self.h_max);
            comp.y = (self.height * comp.v).div_ceil(self.v_max);
            comp.w2 = self.mcu_x * comp.h * 8;
            comp.h2 = self.mcu_y * comp.v * 8;
            let samples = (comp.w2 * comp.h2) as u64;
            total += if self.progressive {
                3 * samples
            } else {
                samples
            };
            blocks += samples / 64;
        }
        if total > MAX_DECODE_BYTES {
            return Err(format!(
                "decoding the {}×{} JPEG would take {total} bytes, more than {MAX_DECODE_BYTES}",
                self.width, self.height
            ));
        }
        self.blocks_left = blocks
            * if self.progressive {
                PROGRESSIVE_SCAN_FACTOR
            } else {
                BASELINE_SCAN_FACTOR
            };
        let progressive = self.progressive;
        for comp in &mut self.comps {
            comp.data = vec![0; comp.w2 * comp.h2];
            if progressive {
                comp.coeff_w = comp.w2 / 8;
                comp.coeff = vec![0; comp.w2 * comp.h2];
            }
        }
        Ok(())
    }

    fn decode_header(&mut self) -> Result<(), String> {
        self.jfif = false;
        self.app14_color_transform = -1;
        self.bits.marker = MARKER_NONE;
        if self.bits.get_marker() != 0xd8 {
            return Err("not a JPEG: no SOI marker".into());
        }
        let mut m = self.bits.get_marker();
        while !matches!(m, 0xc0..=0xc2) {
            self.process_marker(m)?;
            m = self.bits.get_marker();
            while m == MARKER_NONE {
                if self.bits.s.at_eof() {
                    return Err(corrupt("no SOF marker"));
                }
                m = self.bits.get_marker();
            }
        }
        self.progressive = m == 0xc2;
        self.process_frame_header()
    }

    fn skip_junk_at_end(&mut self) -> u8 {
        let s = &mut self.bits.s;
        while !s.at_eof() {
            let mut x = s.get8();
            while x == 0xff {
                if s.at_eof() {
                    return MARKER_NONE;
                }
                x = s.get8();
                if x != 0x00 && x != 0xff {
                    return x;
                }
            }
        }
        MARKER_NONE
    }

    fn decode_image(&mut self) -> Result<(), String> {
        self.restart_interval = 0;
        self.decode_header()?;
        let mut m = self.bits.get_marker();
        let mut scans = 0;
        while m != 0xd9 {
            if m == 0xda {
                self.process_scan_header()?;
                self.parse_entropy_coded_data()?;
                scans += 1;
                if self.bits.marker == MARKER_NONE {
                    self.bits.marker = self.skip_junk_at_end();
                }
                m = self.bits.get_marker();
                if is_restart(m) {
                    m = self.bits.get_marker();
                }
            } else if m == 0xdc {
                let ld = self.s().get16be();
                let nl = self.s().get16be();
                if ld != 4 {
                    return Err(corrupt("bad DNL length"));
                }
                if nl as usize != self.height {
                    return Err(corrupt("bad DNL height"));
                }
                m = self.bits.get_marker();
            } else {
                // stb ends the picture as it stands at a marker it does not know (the end of the bytes
                // included).
                if self.process_marker(m).is_err() {
                    break;
                }
                m = self.bits.get_marker();
            }
        }
        // stb returns its never-written buffers here (whatever the memory held): refused instead.
        if scans == 0 {
            return Err(corrupt("no image data (no scan before the end)"));
        }
        if self.progressive {
            self.finish_progressive();
        }
        Ok(())
    }

    fn parse_entropy_coded_data(&mut self) -> Result<(), String> {
        self.reset();
        if self.scan_n == 1 {
            let n = self.order[0];
            let w = self.comps[n].x.div_ceil(8);
            let h = self.comps[n].y.div_ceil(8);
            for j in 0..h {
                for i in 0..w {
                    self.spend_block()?;
                    if self.progressive {
                        let at = 64 * (i + j * self.comps[n].coeff_w);
                        if self.spec_start == 0 {
                            self.decode_block_prog_dc(n, at)?;
                        } else {
                            self.decode_block_prog_ac(n, at)?;
                        }
                    } else {
                        let mut data = [0i16; 64];
                        self.decode_block(n, &mut data)?;
                        let c = &mut self.comps[n];
                        idct_block(&mut c.data[c.w2 * j * 8 + i * 8..], c.w2, &data, &self.idct);
                    }
                    if !self.count_restart() {
                        return Ok(());
                    }
                }
            }
        } else {
            for j in 0..self.mcu_y {
                for i in 0..self.mcu_x {
                    for k in 0..self.scan_n {
                        let n = self.order[k];
                        for y in 0..self.comps[n].v {
                            for x in 0..self.comps[n].h {
                                self.spend_block()?;
                                let x2 = i * self.comps[n].h + x;
                                let y2 = j * self.comps[n].v + y;
                                if self.progressive {
                                    let at = 64 * (x2 + y2 * self.comps[n].coeff_w);
                                    self.decode_block_prog_dc(n, at)?;
                                } else {
                                    let mut data = [0i16; 64];
                                    self.decode_block(n, &mut data)?;
                                    let c = &mut self.comps[n];
                                    idct_block(
                                        &mut c.data[c.w2 * y2 * 8 + x2 * 8..],
                                        c.w2,
                                        &data,
                                        &self.idct,
                                    );
                                }
                            }
                        }
                    }
                    if !self.count_restart() {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    fn finish_progressive(&mut self) {
        for c in &mut self.comps {
            let dequant = &self.dequant[c.tq];
            let (w, h) = (c.x.div_ceil(8), c.y.div_ceil(8));
            for j in 0..h {
                for i in 0..w {
                    let at = 64 * (i + j * c.coeff_w);
                    let mut data = [0i16; 64];
                    for (t, (d, q)) in data
                        .iter_mut()
                        .zip(c.coeff[at..at + 64].iter().zip(dequant))
                    {
                        *t = (*d as i32 * *q as i32) as i16;
                    }
                    idct_block(&mut c.data[c.w2 * j * 8 + i * 8..], c.w2, &data, &self.idct);
                }
            }
        }
    }
}
