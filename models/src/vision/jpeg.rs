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

use super::picture::{Rgb8, MAX_DECODE_BYTES, MAX_SIDE};

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

/// `(1 << n) - 1`.
const BMASK: [u32; 17] = [
    0, 1, 3, 7, 15, 31, 63, 127, 255, 511, 1023, 2047, 4095, 8191, 16383, 32767, 65535,
];

/// `(-1 << n) + 1`.
const JBIAS: [i32; 16] = [
    0, -1, -3, -7, -15, -31, -63, -127, -255, -511, -1023, -2047, -4095, -8191, -16383, -32767,
];

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

/// The bytes, read as stb reads memory: past the end every byte is 0.
struct Source<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Source<'_> {
    fn get8(&mut self) -> u8 {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                b
            }
            None => 0,
        }
    }
    fn get16be(&mut self) -> i32 {
        let hi = self.get8() as i32;
        (hi << 8) | self.get8() as i32
    }
    fn at_eof(&self) -> bool {
        self.pos >= self.buf.len()
    }
    fn skip(&mut self, n: i32) {
        if n < 0 {
            self.pos = self.buf.len();
        } else {
            self.pos = self.pos.saturating_add(n as usize);
        }
    }
}

/// A Huffman table in stb's layout (a never-defined table is all zeros, as stb's is).
#[derive(Clone)]
struct Huffman {
    fast: [u8; FAST_SIZE],
    code: [u16; 256],
    values: [u8; 256],
    size: [u8; 257],
    maxcode: [u32; 18],
    delta: [i32; 17],
}

impl Default for Huffman {
    fn default() -> Self {
        Huffman {
            fast: [0; FAST_SIZE],
            code: [0; 256],
            values: [0; 256],
            size: [0; 257],
            maxcode: [0; 18],
            delta: [0; 17],
        }
    }
}

impl Huffman {
    fn build(&mut self, count: &[usize; 16]) -> Result<(), String> {
        let mut k = 0usize;
        for (i, &n) in count.iter().enumerate() {
            for _ in 0..n {
                self.size[k] = (i + 1) as u8;
                k += 1;
                if k >= 257 {
                    return Err("corrupt JPEG: bad Huffman size list".into());
                }
            }
        }
        self.size[k] = 0;
        let mut code: u32 = 0;
        k = 0;
        for j in 1..=16usize {
            self.delta[j] = (k as i32).wrapping_sub(code as i32);
            if self.size[k] as usize == j {
                while self.size[k] as usize == j {
                    self.code[k] = code as u16;
                    k += 1;
                    code += 1;
                }
                if code > (1u32 << j) {
                    return Err("corrupt JPEG: bad Huffman code lengths".into());
                }
            }
            self.maxcode[j] = code << (16 - j);
            code <<= 1;
        }
        self.maxcode[17] = 0xffff_ffff;
        self.fast = [255; FAST_SIZE];
        for i in 0..k {
            let s = self.size[i] as u32;
            if s <= FAST_BITS {
                let c = (self.code[i] as usize) << (FAST_BITS - s);
                let m = 1usize << (FAST_BITS - s);
                for j in 0..m {
                    self.fast[c + j] = i as u8;
                }
            }
        }
        Ok(())
    }

    /// The table decoding a small AC coefficient's run, size and value in one look (0: not there).
    fn fast_ac(&self) -> [i16; FAST_SIZE] {
        let mut out = [0i16; FAST_SIZE];
        for (i, slot) in out.iter_mut().enumerate() {
            let fast = self.fast[i];
            if fast < 255 {
                let rs = self.values[fast as usize] as i32;
                let run = (rs >> 4) & 15;
                let magbits = rs & 15;
                let len = self.size[fast as usize] as i32;
                if magbits != 0 && len + magbits <= FAST_BITS as i32 {
                    let mut k = (((i as i32) << len) & (FAST_SIZE as i32 - 1))
                        >> (FAST_BITS as i32 - magbits);
                    let m = 1 << (magbits - 1);
                    if k < m {
                        k = k.wrapping_add(((!0u32) << magbits).wrapping_add(1) as i32);
                    }
                    if (-128..=127).contains(&k) {
                        *slot = (k * 256 + run * 16 + (len + magbits)) as i16;
                    }
                }
            }
        }
        out
    }
}

/// The entropy-coded bit reader.
struct Bits<'a> {
    s: Source<'a>,
    code_buffer: u32,
    code_bits: i32,
    marker: u8,
    nomore: bool,
}

impl Bits<'_> {
    fn grow(&mut self) {
        loop {
            let b = if self.nomore { 0 } else { self.s.get8() as u32 };
            if b == 0xff {
                let mut c = self.s.get8();
                while c == 0xff {
                    c = self.s.get8();
                }
                if c != 0 {
                    self.marker = c;
                    self.nomore = true;
                    return;
                }
            }
            self.code_buffer |= b << (24 - self.code_bits);
            self.code_bits += 8;
            if self.code_bits > 24 {
                return;
            }
        }
    }

    /// The next symbol of `h`, or -1 for a code not in it.
    fn huff_decode(&mut self, h: &Huffman) -> i32 {
        if self.code_bits < 16 {
            self.grow();
        }
        let c = ((self.code_buffer >> (32 - FAST_BITS)) as usize) & (FAST_SIZE - 1);
        let k = h.fast[c];
        if k < 255 {
            let s = h.size[k as usize] as i32;
            if s > self.code_bits {
                return -1;
            }
            self.code_buffer <<= s;
            self.code_bits -= s;
            return h.values[k as usize] as i32;
        }
        let temp = self.code_buffer >> 16;
        let mut k = FAST_BITS as usize + 1;
        while k < 17 && temp >= h.maxcode[k] {
            k += 1;
        }
        if k == 17 {
            self.code_bits -= 16;
            return -1;
        }
        if k as i32 > self.code_bits {
            return -1;
        }
        let c = (((self.code_buffer >> (32 - k)) & BMASK[k]) as i32).wrapping_add(h.delta[k]);
        if !(0..256).contains(&c) {
            return -1;
        }
        self.code_bits -= k as i32;
        self.code_buffer <<= k;
        h.values[c as usize] as i32
    }

    fn extend_receive(&mut self, n: i32) -> i32 {
        if self.code_bits < n {
            self.grow();
        }
        if self.code_bits < n || n <= 0 {
            return 0;
        }
        let sgn = (self.code_buffer >> 31) as i32;
        let mut k = self.code_buffer.rotate_left(n as u32);
        self.code_buffer = k & !BMASK[n as usize];
        k &= BMASK[n as usize];
        self.code_bits -= n;
        (k as i32).wrapping_add(JBIAS[n as usize] & (sgn - 1))
    }

    fn get_bits(&mut self, n: i32) -> i32 {
        if self.code_bits < n {
            self.grow();
        }
        if self.code_bits < n || n <= 0 {
            return 0;
        }
        let mut k = self.code_buffer.rotate_left(n as u32);
        self.code_buffer = k & !BMASK[n as usize];
        k &= BMASK[n as usize];
        self.code_bits -= n;
        k as i32
    }

    fn get_bit(&mut self) -> bool {
        if self.code_bits < 1 {
            self.grow();
        }
        if self.code_bits < 1 {
            return false;
        }
        let k = self.code_buffer;
        self.code_buffer <<= 1;
        self.code_bits -= 1;
        k & 0x8000_0000 != 0
    }

    /// A pending marker from the entropy data, else the next one in the bytes (`MARKER_NONE` if the next
    /// byte starts none).
    fn get_marker(&mut self) -> u8 {
        if self.marker != MARKER_NONE {
            let x = self.marker;
            self.marker = MARKER_NONE;
            return x;
        }
        let mut x = self.s.get8();
        if x != 0xff {
            return MARKER_NONE;
        }
        while x == 0xff {
            x = self.s.get8();
        }
        x
    }
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

fn mul2shorts_valid(a: i32, b: i32) -> bool {
    if b == 0 || b == -1 {
        return true;
    }
    if (a >= 0) == (b >= 0) {
        return a <= i16::MAX as i32 / b;
    }
    if b < 0 {
        return a <= i16::MIN as i32 / b;
    }
    a >= i16::MIN as i32 / b
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

    fn decode_block(&mut self, n: usize, data: &mut [i16; 64]) -> Result<(), String> {
        let bits = &mut self.bits;
        let comp = &mut self.comps[n];
        let hdc = &self.huff_dc[comp.hd];
        let hac = &self.huff_ac[comp.ha];
        let fac = &self.fast_ac[comp.ha];
        let dequant = &self.dequant[comp.tq];
        if bits.code_bits < 16 {
            bits.grow();
        }
        let t = bits.huff_decode(hdc);
        if !(0..=15).contains(&t) {
            return Err(corrupt("bad Huffman code"));
        }
        *data = [0; 64];
        let diff = if t != 0 { bits.extend_receive(t) } else { 0 };
        let dc = comp
            .dc_pred
            .checked_add(diff)
            .ok_or_else(|| corrupt("bad DC delta"))?;
        comp.dc_pred = dc;
        if !mul2shorts_valid(dc, dequant[0] as i32) {
            return Err(corrupt("DC out of range"));
        }
        data[0] = (dc * dequant[0] as i32) as i16;
        let mut k = 1usize;
        loop {
            if bits.code_bits < 16 {
                bits.grow();
            }
            let c = ((bits.code_buffer >> (32 - FAST_BITS)) as usize) & (FAST_SIZE - 1);
            let r = fac[c] as i32;
            if r != 0 {
                k += ((r >> 4) & 15) as usize;
                let s = r & 15;
                if s > bits.code_bits {
                    return Err(corrupt("bad Huffman code"));
                }
                bits.code_buffer <<= s;
                bits.code_bits -= s;
                let zig = DEZIGZAG[k];
                k += 1;
                data[zig] = ((r >> 8).wrapping_mul(dequant[zig] as i32)) as i16;
            } else {
                let rs = bits.huff_decode(hac);
                if rs < 0 {
                    return Err(corrupt("bad Huffman code"));
                }
                let s = rs & 15;
                let r = rs >> 4;
                if s == 0 {
                    if rs != 0xf0 {
                        break;
                    }
                    k += 16;
                } else {
                    k += r as usize;
                    let zig = DEZIGZAG[k];
                    k += 1;
                    data[zig] = bits.extend_receive(s).wrapping_mul(dequant[zig] as i32) as i16;
                }
            }
            if k >= 64 {
                break;
            }
        }
        Ok(())
    }

    fn decode_block_prog_dc(&mut self, n: usize, at: usize) -> Result<(), String> {
        if self.spec_end != 0 {
            return Err(corrupt("can't merge DC and AC"));
        }
        let bits = &mut self.bits;
        if bits.code_bits < 16 {
            bits.grow();
        }
        let comp = &mut self.comps[n];
        let data = &mut comp.coeff[at..at + 64];
        if self.succ_high == 0 {
            data.fill(0);
            let t = bits.huff_decode(&self.huff_dc[comp.hd]);
            if !(0..=15).contains(&t) {
                return Err(corrupt("bad Huffman code"));
            }
            let diff = if t != 0 { bits.extend_receive(t) } else { 0 };
            let dc = comp
                .dc_pred
                .checked_add(diff)
                .ok_or_else(|| corrupt("bad DC delta"))?;
            comp.dc_pred = dc;
            if !mul2shorts_valid(dc, 1 << self.succ_low) {
                return Err(corrupt("DC out of range"));
            }
            data[0] = (dc * (1 << self.succ_low)) as i16;
        } else if bits.get_bit() {
            data[0] = data[0].wrapping_add((1i32 << self.succ_low) as i16);
        }
        Ok(())
    }

    fn decode_block_prog_ac(&mut self, n: usize, at: usize) -> Result<(), String> {
        if self.spec_start == 0 {
            return Err(corrupt("can't merge DC and AC"));
        }
        let bits = &mut self.bits;
        let comp = &mut self.comps[n];
        let hac = &self.huff_ac[comp.ha];
        let fac = &self.fast_ac[comp.ha];
        let data = &mut comp.coeff[at..at + 64];
        let spec_end = self.spec_end;
        if self.succ_high == 0 {
            let shift = self.succ_low;
            if self.eob_run != 0 {
                self.eob_run -= 1;
                return Ok(());
            }
            let mut k = self.spec_start;
            loop {
                if bits.code_bits < 16 {
                    bits.grow();
                }
                let c = ((bits.code_buffer >> (32 - FAST_BITS)) as usize) & (FAST_SIZE - 1);
                let r = fac[c] as i32;
                if r != 0 {
                    k += ((r >> 4) & 15) as usize;
                    let s = r & 15;
                    if s > bits.code_bits {
                        return Err(corrupt("bad Huffman code"));
                    }
                    bits.code_buffer <<= s;
                    bits.code_bits -= s;
                    let zig = DEZIGZAG[k];
                    k += 1;
                    data[zig] = ((r >> 8) * (1 << shift)) as i16;
                } else {
                    let rs = bits.huff_decode(hac);
                    if rs < 0 {
                        return Err(corrupt("bad Huffman code"));
                    }
                    let s = rs & 15;
                    let r = rs >> 4;
                    if s == 0 {
                        if r < 15 {
                            self.eob_run = 1 << r;
                            if r != 0 {
                                self.eob_run += bits.get_bits(r);
                            }
                            self.eob_run -= 1;
                            break;
                        }
                        k += 16;
                    } else {
                        k += r as usize;
                        let zig = DEZIGZAG[k];
                        k += 1;
                        data[zig] = bits.extend_receive(s).wrapping_mul(1 << shift) as i16;
                    }
                }
                if k > spec_end {
                    break;
                }
            }
        } else {
            let bit = (1i32 << self.succ_low) as i16;
            // A coefficient already nonzero takes one correction bit, moving it away from zero.
            let refine = |bits: &mut Bits, p: &mut i16| {
                if bits.get_bit() && (*p & bit) == 0 {
                    *p = if *p > 0 {
                        p.wrapping_add(bit)
                    } else {
                        p.wrapping_sub(bit)
                    };
                }
            };
            if self.eob_run != 0 {
                self.eob_run -= 1;
                for k in self.spec_start..=spec_end {
                    let p = &mut data[DEZIGZAG[k]];
                    if *p != 0 {
                        refine(bits, p);
                    }
                }
            } else {
                let mut k = self.spec_start;
                loop {
                    let rs = bits.huff_decode(hac);
                    if rs < 0 {
                        return Err(corrupt("bad Huffman code"));
                    }
                    let mut s = rs & 15;
                    let mut r = rs >> 4;
                    if s == 0 {
                        if r < 15 {
                            self.eob_run = (1 << r) - 1;
                            if r != 0 {
                                self.eob_run += bits.get_bits(r);
                            }
                            r = 64;
                        }
                    } else {
                        if s != 1 {
                            return Err(corrupt("bad Huffman code"));
                        }
                        s = if bits.get_bit() {
                            bit as i32
                        } else {
                            -(bit as i32)
                        };
                    }
                    while k <= spec_end {
                        let p = &mut data[DEZIGZAG[k]];
                        k += 1;
                        if *p != 0 {
                            refine(bits, p);
                        } else {
                            if r == 0 {
                                *p = s as i16;
                                break;
                            }
                            r -= 1;
                        }
                    }
                    if k > spec_end {
                        break;
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

    fn to_rgb(&self) -> Result<Rgb8, String> {
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
fn f2f(x: f32) -> i32 {
    ((x * 4096.0) as f64 + 0.5) as i32
}

/// The constant pairs of the SSE2 IDCT's `pmaddwd` rotations.
struct IdctConsts {
    rot0: [(i32, i32); 2],
    rot1: [(i32, i32); 2],
    rot2: [(i32, i32); 2],
    rot3: [(i32, i32); 2],
}

// stb's constants as it writes them (f32 literals of jidctint's), so that they round as there.
#[allow(clippy::excessive_precision)]
fn idct_consts() -> IdctConsts {
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
fn idct_block(out: &mut [u8], stride: usize, data: &[i16; 64], k: &IdctConsts) {
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

#[cfg(test)]
mod tests {
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
}
