//! The entropy-coded side: the bytes as stb reads them, Huffman tables, the bit reader, and the
//! decoding of a block's coefficients (baseline, and progressive DC and AC scans).

use super::{corrupt, Decoder, DEZIGZAG, FAST_BITS, FAST_SIZE, MARKER_NONE};

/// `(1 << n) - 1`.
const BMASK: [u32; 17] = [
    0, 1, 3, 7, 15, 31, 63, 127, 255, 511, 1023, 2047, 4095, 8191, 16383, 32767, 65535,
];

/// `(-1 << n) + 1`.
const JBIAS: [i32; 16] = [
    0, -1, -3, -7, -15, -31, -63, -127, -255, -511, -1023, -2047, -4095, -8191, -16383, -32767,
];

/// The bytes, read as stb reads memory: past the end every byte is 0.
pub(super) struct Source<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl Source<'_> {
    pub(super) fn get8(&mut self) -> u8 {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                b
            }
            None => 0,
        }
    }
    pub(super) fn get16be(&mut self) -> i32 {
        let hi = self.get8() as i32;
        (hi << 8) | self.get8() as i32
    }
    pub(super) fn at_eof(&self) -> bool {
        self.pos >= self.buf.len()
    }
    pub(super) fn skip(&mut self, n: i32) {
        if n < 0 {
            self.pos = self.buf.len();
        } else {
            self.pos = self.pos.saturating_add(n as usize);
        }
    }
}

/// A Huffman table in stb's layout (a never-defined table is all zeros, as stb's is).
#[derive(Clone)]
pub(super) struct Huffman {
    fast: [u8; FAST_SIZE],
    code: [u16; 256],
    pub(super) values: [u8; 256],
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
    pub(super) fn build(&mut self, count: &[usize; 16]) -> Result<(), String> {
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
    pub(super) fn fast_ac(&self) -> [i16; FAST_SIZE] {
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
pub(super) struct Bits<'a> {
    pub(super) s: Source<'a>,
    pub(super) code_buffer: u32,
    pub(super) code_bits: i32,
    pub(super) marker: u8,
    pub(super) nomore: bool,
}

impl Bits<'_> {
    pub(super) fn grow(&mut self) {
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

    /// The next DC coefficient through `h`: the coded difference added to the component's prediction
    /// `pred` (updated), times `scale` (the quantizer, or a progressive scan's `1 << succ_low`).
    fn dc(&mut self, h: &Huffman, pred: &mut i32, scale: i32) -> Result<i16, String> {
        let t = self.huff_decode(h);
        if !(0..=15).contains(&t) {
            return Err(corrupt("bad Huffman code"));
        }
        let diff = if t != 0 { self.extend_receive(t) } else { 0 };
        let dc = pred
            .checked_add(diff)
            .ok_or_else(|| corrupt("bad DC delta"))?;
        *pred = dc;
        if !mul2shorts_valid(dc, scale) {
            return Err(corrupt("DC out of range"));
        }
        Ok((dc * scale) as i16)
    }

    /// The next AC coefficient through the fast table `fac` (stb's `fast_ac`: run, size and value of the
    /// short codes in one entry): `Some((run, value))` with its bits consumed, or `None` when the code
    /// is not in the table (the caller decodes it through the Huffman table).
    fn fast_ac(&mut self, fac: &[i16; FAST_SIZE]) -> Result<Option<(usize, i32)>, String> {
        if self.code_bits < 16 {
            self.grow();
        }
        let c = ((self.code_buffer >> (32 - FAST_BITS)) as usize) & (FAST_SIZE - 1);
        let r = fac[c] as i32;
        if r == 0 {
            return Ok(None);
        }
        let s = r & 15;
        if s > self.code_bits {
            return Err(corrupt("bad Huffman code"));
        }
        self.code_buffer <<= s;
        self.code_bits -= s;
        Ok(Some((((r >> 4) & 15) as usize, r >> 8)))
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
    pub(super) fn get_marker(&mut self) -> u8 {
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

impl Decoder<'_> {
    pub(super) fn decode_block(&mut self, n: usize, data: &mut [i16; 64]) -> Result<(), String> {
        let bits = &mut self.bits;
        let comp = &mut self.comps[n];
        let hdc = &self.huff_dc[comp.hd];
        let hac = &self.huff_ac[comp.ha];
        let fac = &self.fast_ac[comp.ha];
        let dequant = &self.dequant[comp.tq];
        if bits.code_bits < 16 {
            bits.grow();
        }
        *data = [0; 64];
        data[0] = bits.dc(hdc, &mut comp.dc_pred, dequant[0] as i32)?;
        let mut k = 1usize;
        loop {
            if let Some((run, value)) = bits.fast_ac(fac)? {
                k += run;
                let zig = DEZIGZAG[k];
                k += 1;
                data[zig] = (value.wrapping_mul(dequant[zig] as i32)) as i16;
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

    pub(super) fn decode_block_prog_dc(&mut self, n: usize, at: usize) -> Result<(), String> {
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
            data[0] = bits.dc(
                &self.huff_dc[comp.hd],
                &mut comp.dc_pred,
                1 << self.succ_low,
            )?;
        } else if bits.get_bit() {
            data[0] = data[0].wrapping_add((1i32 << self.succ_low) as i16);
        }
        Ok(())
    }

    pub(super) fn decode_block_prog_ac(&mut self, n: usize, at: usize) -> Result<(), String> {
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
                if let Some((run, value)) = bits.fast_ac(fac)? {
                    k += run;
                    let zig = DEZIGZAG[k];
                    k += 1;
                    data[zig] = (value * (1 << shift)) as i16;
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
}
