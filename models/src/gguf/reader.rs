//! Parsing a GGUF header from a byte slice: magic, version, metadata, tensor infos, and the validation
//! rules of llama.cpp's `ggml/src/gguf.cpp` (plus bounds checks of every tensor against the file).
//!
//! The parser reads only the header, so parsing a memory-mapped 20 GB file touches a few pages; it never
//! indexes out of bounds and never allocates more than the remaining bytes of the input can justify, so
//! arbitrary input (the fuzz target) gives an error, not a panic or an absurd allocation.

use std::collections::HashSet;
use std::fmt::Write as _;

use poly_kernels::GgmlType;

use super::error::{ErrorKind, GgufError, Section};
use super::metadata::{keys, Metadata};
use super::value::{Array, Value, ValueType};
use super::{
    TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_ARRAY_ELEMENTS, MAX_DIMS,
    MAX_STRING_LEN, MAX_TENSOR_NAME_LEN,
};

type Result<T> = std::result::Result<T, GgufError>;

/// The parsed header of one GGUF file: everything but the tensor data, which stays in the input.
#[derive(Clone, Debug)]
pub struct ParsedHeader {
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Alignment of the data section and of every tensor offset in it.
    pub alignment: u64,
    /// Metadata in file order.
    pub metadata: Metadata,
    /// Tensor infos in file order; `part` is 0 and `offset` is absolute in the parsed bytes.
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts.
    pub data_offset: u64,
    /// Length of the parsed input.
    pub file_len: u64,
}

/// Parses and validates the header of the GGUF file `bytes`; `name_for_errors` names it in errors.
///
/// Checks (llama.cpp's rules and ours): magic, version 2 or 3 (big-endian files are recognised and
/// refused), keys non-empty and unique, value types known, string and array lengths within 2^30 and within
/// the input, `general.alignment` a `u32` power of two, tensor names shorter than 64 bytes and unique, at
/// most 4 dimensions each at most `i64::MAX` with a product that fits, a known tensor type with the first
/// dimension a multiple of its block, offsets aligned and back to back in order, and every tensor inside
/// the input.
pub fn parse_gguf_bytes(bytes: &[u8], name_for_errors: &str) -> Result<ParsedHeader> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        name: name_for_errors,
        section: Section::Header,
        context: String::from("magic"),
    };

    let found = &bytes[..bytes.len().min(4)];
    if found != &GGUF_MAGIC[..found.len()] {
        return Err(c.error(ErrorKind::BadMagic {
            found: found.to_vec(),
        }));
    }
    c.take(4)?;
    c.set_context(format_args!("version"));
    let version = c.u32()?;
    if version != 0 && version & 0xFFFF == 0 {
        return Err(c.error(ErrorKind::BigEndian {
            raw_version: version,
        }));
    }
    if !(2..=3).contains(&version) {
        return Err(c.error(ErrorKind::UnsupportedVersion { version }));
    }
    c.set_context(format_args!("tensor count"));
    let n_tensors = c.u64()?;
    c.set_context(format_args!("metadata count"));
    let n_kv = c.u64()?;

    c.section = Section::Metadata;
    let mut metadata = Metadata::new(name_for_errors);
    // Each pair takes at least 13 bytes (key length, type, a one-byte value): cap the reservation by what
    // the input can hold.
    metadata.reserve(n_kv.min((c.remaining() / 13) as u64) as usize);
    for i in 0..n_kv {
        c.set_context(format_args!("key #{i}"));
        let key = c.string("metadata key")?;
        if key.is_empty() {
            return Err(c.error(ErrorKind::EmptyKey { index: i }));
        }
        c.set_context(format_args!("key '{key}'"));
        if metadata.contains_key(&key) {
            return Err(c.error(ErrorKind::DuplicateKey { key }));
        }
        let type_id = c.u32()?;
        let value = c.value(type_id, &key)?;
        metadata.insert_new(key, value);
    }

    let alignment = match metadata.get(keys::GENERAL_ALIGNMENT) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(v) => {
            return Err(c.error(ErrorKind::BadAlignment {
                value: format!("{v:?}"),
            }))
        }
    };

    c.section = Section::TensorInfo;
    // Each tensor info takes at least 24 bytes (name length, dims count, type, offset).
    let mut tensors = Vec::with_capacity(n_tensors.min((c.remaining() / 24) as u64) as usize);
    let mut relative_offsets = Vec::with_capacity(tensors.capacity());
    let mut seen = HashSet::with_capacity(tensors.capacity());
    for i in 0..n_tensors {
        c.set_context(format_args!("tensor #{i}"));
        let (info, relative_offset) = c.tensor_info()?;
        if !seen.insert(info.name.clone()) {
            return Err(c.error(ErrorKind::DuplicateTensor { name: info.name }));
        }
        tensors.push(info);
        relative_offsets.push(relative_offset);
    }

    c.section = Section::TensorData;
    let header_end = c.pos as u64;
    let file_len = bytes.len() as u64;
    let data_offset = if n_tensors > 0 {
        let padded = align_up(header_end, alignment).unwrap_or(u64::MAX);
        if padded > file_len {
            c.set_context(format_args!("padding before the tensor data"));
            return Err(c.truncated(padded - header_end));
        }
        padded
    } else {
        header_end
    };

    let mut expected = 0u64;
    for (info, &rel) in tensors.iter_mut().zip(&relative_offsets) {
        if rel % alignment != 0 {
            return Err(c.error(ErrorKind::MisalignedOffset {
                tensor: info.name.clone(),
                offset: rel,
                alignment,
            }));
        }
        let start = data_offset.checked_add(rel);
        let end = start.and_then(|s| s.checked_add(info.n_bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => info.offset = start,
            _ => {
                return Err(c.error(ErrorKind::TensorOutOfBounds {
                    tensor: info.name.clone(),
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_len,
                }))
            }
        }
        if rel != expected {
            return Err(c.error(ErrorKind::UnexpectedOffset {
                tensor: info.name.clone(),
                offset: rel,
                expected,
            }));
        }
        expected = align_up(info.n_bytes, alignment)
            .and_then(|padded| expected.checked_add(padded))
            .ok_or_else(|| {
                c.error(ErrorKind::SizeOverflow {
                    tensor: info.name.clone(),
                    dims: info.dims.clone(),
                })
            })?;
    }

    Ok(ParsedHeader {
        version,
        alignment,
        metadata,
        tensors,
        data_offset,
        file_len,
    })
}

/// `x` rounded up to a multiple of the power of two `alignment`; `None` on overflow.
pub(crate) fn align_up(x: u64, alignment: u64) -> Option<u64> {
    Some(x.checked_add(alignment - 1)? & !(alignment - 1))
}

/// A read position in the input, with what is being read for error messages.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    name: &'a str,
    section: Section,
    /// What is being read ("key 'general.name'", "tensor #3"); rebuilt in place for each item.
    context: String,
}

impl<'a> Cursor<'a> {
    fn set_context(&mut self, args: std::fmt::Arguments<'_>) {
        self.context.clear();
        let _ = self.context.write_fmt(args);
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn error(&self, kind: ErrorKind) -> GgufError {
        GgufError::new(self.name, kind)
    }

    fn truncated(&self, needed: u64) -> GgufError {
        self.error(ErrorKind::Truncated {
            section: self.section,
            context: self.context.clone(),
            offset: self.pos as u64,
            needed,
            file_len: self.bytes.len() as u64,
        })
    }

    /// The next `n` bytes.
    fn take(&mut self, n: u64) -> Result<&'a [u8]> {
        if n > self.remaining() as u64 {
            return Err(self.truncated(n));
        }
        let n = n as usize;
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// Checks that `n` items of at least `min_size` bytes each can be in the rest of the input (and that
    /// `n` is within llama.cpp's limit) before anything is allocated for them.
    fn check_count(&self, what: &str, n: u64, min_size: u64) -> Result<usize> {
        if n > MAX_ARRAY_ELEMENTS {
            return Err(self.error(ErrorKind::LengthTooLarge {
                what: format!("{what} of {}", self.context),
                len: n,
                limit: MAX_ARRAY_ELEMENTS,
            }));
        }
        let needed = n * min_size; // n ≤ 2^30 and min_size ≤ 12: no overflow
        if needed > self.remaining() as u64 {
            return Err(self.truncated(needed));
        }
        Ok(n as usize)
    }

    /// A length-prefixed string.
    fn string(&mut self, what: &str) -> Result<String> {
        let bytes = self.string_bytes(what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(self.error(ErrorKind::InvalidUtf8 {
                what: format!("{what} of {}", self.context),
            })),
        }
    }

    fn string_bytes(&mut self, what: &str) -> Result<&'a [u8]> {
        let len = self.u64()?;
        if len > MAX_STRING_LEN {
            return Err(self.error(ErrorKind::LengthTooLarge {
                what: format!("{what} of {}", self.context),
                len,
                limit: MAX_STRING_LEN,
            }));
        }
        self.take(len)
    }

    /// A value of type `type_id` (after the key and the type).
    fn value(&mut self, type_id: u32, key: &str) -> Result<Value> {
        let Some(ty) = ValueType::from_id(type_id) else {
            return Err(self.error(ErrorKind::UnknownValueType {
                key: key.to_string(),
                id: type_id,
            }));
        };
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array()?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array()?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array()?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array()?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array()?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array()?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array()?)),
            // As llama.cpp: any non-zero byte is true.
            ValueType::Bool => Value::Bool(self.array::<1>()?[0] != 0),
            ValueType::String => Value::String(self.string("string value")?),
            ValueType::Array => Value::Array(self.array_value(key, 1)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array()?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array()?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array()?)),
        })
    }

    /// An array: element type, count, elements. `depth` is 1 for a top-level array.
    fn array_value(&mut self, key: &str, depth: usize) -> Result<Array> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.error(ErrorKind::ArrayTooDeep {
                key: key.to_string(),
            }));
        }
        let elem_id = self.u32()?;
        let Some(elem) = ValueType::from_id(elem_id) else {
            return Err(self.error(ErrorKind::UnknownValueType {
                key: key.to_string(),
                id: elem_id,
            }));
        };
        let count = self.u64()?;
        // Strings take at least their 8-byte length, inner arrays their 4-byte type and 8-byte count.
        let min_size = match elem {
            ValueType::String => 8,
            ValueType::Array => 12,
            fixed => fixed.fixed_size().unwrap_or(1) as u64,
        };
        let n = self.check_count("array", count, min_size)?;

        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                const SIZE: usize = std::mem::size_of::<$t>();
                let raw = self.take((n * SIZE) as u64)?;
                Array::$variant(
                    raw.chunks_exact(SIZE)
                        .map(|chunk| {
                            let mut le = [0u8; SIZE];
                            le.copy_from_slice(chunk);
                            <$t>::from_le_bytes(le)
                        })
                        .collect(),
                )
            }};
        }

        Ok(match elem {
            ValueType::U8 => Array::U8(self.take(n as u64)?.to_vec()),
            ValueType::I8 => fixed!(I8, i8),
            ValueType::U16 => fixed!(U16, u16),
            ValueType::I16 => fixed!(I16, i16),
            ValueType::U32 => fixed!(U32, u32),
            ValueType::I32 => fixed!(I32, i32),
            ValueType::F32 => fixed!(F32, f32),
            ValueType::Bool => Array::Bool(self.take(n as u64)?.iter().map(|&b| b != 0).collect()),
            ValueType::String => {
                let mut strings = Vec::with_capacity(n);
                for _ in 0..n {
                    strings.push(self.string("array string")?);
                }
                Array::String(strings)
            }
            ValueType::Array => {
                let mut arrays = Vec::with_capacity(n);
                for _ in 0..n {
                    arrays.push(self.array_value(key, depth + 1)?);
                }
                Array::Array(arrays)
            }
            ValueType::U64 => fixed!(U64, u64),
            ValueType::I64 => fixed!(I64, i64),
            ValueType::F64 => fixed!(F64, f64),
        })
    }

    /// One tensor info; the offset returned is relative to the data section (`info.offset` is filled in
    /// later, once the data section's start is known).
    fn tensor_info(&mut self) -> Result<(TensorInfo, u64)> {
        let name = self.string("tensor name")?;
        if name.len() >= MAX_TENSOR_NAME_LEN {
            let len = name.len();
            return Err(self.error(ErrorKind::TensorNameTooLong { name, len }));
        }
        self.set_context(format_args!("tensor '{name}'"));

        let n_dims = self.u32()?;
        if n_dims as usize > MAX_DIMS {
            return Err(self.error(ErrorKind::TooManyDims {
                tensor: name,
                n_dims,
            }));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let dim = self.u64()?;
            if dim > i64::MAX as u64 {
                return Err(self.error(ErrorKind::DimTooLarge { tensor: name, dim }));
            }
            dims.push(dim);
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64);
        let Some(n_elements) = n_elements else {
            return Err(self.error(ErrorKind::SizeOverflow { tensor: name, dims }));
        };

        let type_id = self.u32()?;
        let Some(ty) = GgmlType::from_id(type_id) else {
            return Err(self.error(ErrorKind::UnknownTensorType {
                tensor: name,
                id: type_id,
            }));
        };
        let ne0 = dims.first().copied().unwrap_or(1);
        let block = ty.block_elems() as u64;
        if ne0 % block != 0 {
            return Err(self.error(ErrorKind::NotBlockMultiple {
                tensor: name,
                ty: ty.name(),
                ne0,
                block,
            }));
        }
        let Some(n_bytes) = ty.bytes_for(n_elements) else {
            return Err(self.error(ErrorKind::SizeOverflow { tensor: name, dims }));
        };

        let offset = self.u64()?;
        Ok((
            TensorInfo {
                name,
                ty,
                dims,
                part: 0,
                offset: 0,
                n_bytes,
            },
            offset,
        ))
    }
}
