//! [`GgufWriter`]: writes GGUF files (or llama.cpp-style split parts) by streaming, one tensor at a time.
//!
//! The caller declares metadata and tensors (name, type, dims), then writes with a callback that fills
//! one tensor's bytes at a time into a buffer the writer reuses, so a 20 GB model never has to be in
//! memory. Files are written to `<path>.tmp` and renamed when complete, so a half-written file never has
//! the final name. The layout is llama.cpp's: header, pairs, tensor infos, padding to the alignment, then
//! each tensor's data padded to the alignment.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use poly_kernels::GgmlType;

use super::error::{ErrorKind, GgufError};
use super::metadata::keys;
use super::reader::align_up;
use super::split::split_path;
use super::value::{Array, Value};
use super::{
    TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_ARRAY_ELEMENTS, MAX_DIMS,
    MAX_STRING_LEN, MAX_TENSOR_NAME_LEN,
};

type Result<T> = std::result::Result<T, GgufError>;

/// Name used in errors raised before any file is known.
const WRITER_NAME: &str = "<GgufWriter>";

/// Builds a GGUF file: metadata, tensor declarations, then a streaming write.
///
/// ```no_run
/// use poly_kernels::GgmlType;
/// use poly_models::gguf::{GgufWriter, Value};
/// # fn main() -> Result<(), poly_models::gguf::GgufError> {
/// let mut w = GgufWriter::new(); // version 3, alignment 32
/// w.set_alignment(64)?;
/// w.add_kv("general.architecture", Value::from("qwen3moe"));
/// w.add_tensor("blk.0.ffn_gate_exps.weight", GgmlType::Q4_K, &[2048, 768, 128])?;
/// w.write_to_path("model.gguf", |_index, _info, out: &mut [u8]| {
///     out.fill(0);
///     Ok(())
/// })?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct GgufWriter {
    version: u32,
    kvs: Vec<(String, Value)>,
    kv_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn writer_error(kind: ErrorKind) -> GgufError {
    GgufError::new(WRITER_NAME, kind)
}

/// `path` with `.tmp` appended to its file name.
fn tmp_path(path: &Path) -> PathBuf {
    let mut s = OsString::from(path.as_os_str());
    s.push(".tmp");
    PathBuf::from(s)
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            kvs: Vec::new(),
            kv_index: HashMap::new(),
            tensors: Vec::new(),
            tensor_index: HashMap::new(),
        }
    }

    /// Writes GGUF version `version` (2 or 3; their little-endian layouts are the same).
    pub fn set_version(&mut self, version: u32) -> Result<()> {
        if !(2..=3).contains(&version) {
            return Err(writer_error(ErrorKind::UnsupportedVersion { version }));
        }
        self.version = version;
        Ok(())
    }

    /// Aligns tensor data to `alignment` bytes (a power of two) and records it as `general.alignment`.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        if !alignment.is_power_of_two() {
            return Err(writer_error(ErrorKind::BadAlignment {
                value: alignment.to_string(),
            }));
        }
        self.add_kv(keys::GENERAL_ALIGNMENT, Value::U32(alignment));
        Ok(())
    }

    /// Sets `key` to `value`; a key set before keeps its position and takes the new value. (Keys are
    /// checked when the file is written: an empty key, or a `general.alignment` that is not a `u32` power
    /// of two, fails the write.)
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<Value>) {
        let key = key.into();
        let value = value.into();
        match self.kv_index.get(&key) {
            Some(&i) => self.kvs[i].1 = value,
            None => {
                self.kv_index.insert(key.clone(), self.kvs.len());
                self.kvs.push((key, value));
            }
        }
    }

    /// The metadata so far, in order.
    pub fn kvs(&self) -> &[(String, Value)] {
        &self.kvs
    }

    /// Declares a tensor. Checks what llama.cpp checks when reading: a unique name shorter than 64 bytes,
    /// at most 4 dimensions, a first dimension that is a whole number of blocks of `ty`, and an element
    /// count and byte size that fit.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
    ) -> Result<()> {
        let name = name.into();
        if name.len() >= MAX_TENSOR_NAME_LEN {
            let len = name.len();
            return Err(writer_error(ErrorKind::TensorNameTooLong { name, len }));
        }
        if self.tensor_index.contains_key(&name) {
            return Err(writer_error(ErrorKind::DuplicateTensor { name }));
        }
        if dims.len() > MAX_DIMS {
            return Err(writer_error(ErrorKind::TooManyDims {
                tensor: name,
                n_dims: dims.len() as u32,
            }));
        }
        let overflow = |name: String| {
            writer_error(ErrorKind::SizeOverflow {
                tensor: name,
                dims: dims.to_vec(),
            })
        };
        let Some(n_elements) = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
        else {
            return Err(overflow(name));
        };
        let ne0 = dims.first().copied().unwrap_or(1);
        let block = ty.block_elems() as u64;
        if ne0 % block != 0 {
            return Err(writer_error(ErrorKind::NotBlockMultiple {
                tensor: name,
                ty: ty.name(),
                ne0,
                block,
            }));
        }
        let Some(n_bytes) = ty
            .bytes_for(n_elements)
            .filter(|&b| usize::try_from(b).is_ok() && b <= i64::MAX as u64)
        else {
            return Err(overflow(name));
        };
        self.tensor_index.insert(name.clone(), self.tensors.len());
        self.tensors.push(TensorInfo {
            name,
            ty,
            dims: dims.to_vec(),
            part: 0,
            offset: 0,
            n_bytes,
        });
        Ok(())
    }

    /// Number of tensors declared.
    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// The alignment the file will use (from `general.alignment`, default 32).
    fn alignment(&self, file: &str) -> Result<u64> {
        match self.kv_index.get(keys::GENERAL_ALIGNMENT) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(&i) => match &self.kvs[i].1 {
                Value::U32(a) if a.is_power_of_two() => Ok(u64::from(*a)),
                v => Err(GgufError::new(
                    file,
                    ErrorKind::BadAlignment {
                        value: format!("{v:?}"),
                    },
                )),
            },
        }
    }

    /// Writes the whole file to `w` (a stream; nothing is seeked). `fill(index, info, out)` must fill
    /// `out` (`info.n_bytes` long, zeroed) with tensor `index`'s data; `info.offset` is where it lands.
    /// Returns the number of bytes written.
    pub fn write_to<W, F>(&self, w: W, mut fill: F) -> Result<u64>
    where
        W: Write,
        F: FnMut(usize, &TensorInfo, &mut [u8]) -> std::io::Result<()>,
    {
        let kvs: Vec<(&str, &Value)> = self.kvs.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let layout = self.layout(WRITER_NAME, &kvs, &self.tensors, 0)?;
        layout.write(w, WRITER_NAME, 0, &mut fill)
    }

    /// The whole file in memory (for tests and small files).
    pub fn to_bytes<F>(&self, fill: F) -> Result<Vec<u8>>
    where
        F: FnMut(usize, &TensorInfo, &mut [u8]) -> std::io::Result<()>,
    {
        let mut out = Vec::new();
        self.write_to(&mut out, fill)?;
        Ok(out)
    }

    /// Writes the file at `path` (through `<path>.tmp`, renamed when complete). See [`Self::write_to`]
    /// for `fill`.
    pub fn write_to_path<F>(&self, path: impl AsRef<Path>, mut fill: F) -> Result<()>
    where
        F: FnMut(usize, &TensorInfo, &mut [u8]) -> std::io::Result<()>,
    {
        let path = path.as_ref();
        let name = path.display().to_string();
        let kvs: Vec<(&str, &Value)> = self.kvs.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let layout = self.layout(&name, &kvs, &self.tensors, 0)?;
        let tmp = tmp_path(path);
        let result = write_file(&tmp, &name, |w| layout.write(w, &name, 0, &mut fill));
        let result = result.and_then(|_| rename(&tmp, path, &name));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Writes a split model as llama.cpp's `gguf-split` does: at most `max_tensors_per_part` tensors per
    /// part, parts named `<base>-00001-of-0000N.gguf` (`base_path` with any `.gguf` extension removed),
    /// each with `split.no`, `split.count` and `split.tensors.count`; the first part holds all the
    /// metadata, the others only the split keys (and `general.alignment` when set). `fill` receives the
    /// tensor's index in the whole model and its info (`part`, `offset` in that part). All parts are
    /// written as `.tmp` files and renamed only once all are complete. Returns the parts' paths.
    pub fn write_split<F>(
        &self,
        base_path: impl AsRef<Path>,
        max_tensors_per_part: usize,
        mut fill: F,
    ) -> Result<Vec<PathBuf>>
    where
        F: FnMut(usize, &TensorInfo, &mut [u8]) -> std::io::Result<()>,
    {
        let base = base_path.as_ref();
        let base = if base.extension().is_some_and(|e| e == "gguf") {
            base.with_extension("")
        } else {
            base.to_path_buf()
        };
        let name = base.display().to_string();
        if max_tensors_per_part == 0 {
            return Err(GgufError::new(
                name,
                ErrorKind::InvalidWrite {
                    detail: "max_tensors_per_part must be at least 1".into(),
                },
            ));
        }
        let chunks: Vec<&[TensorInfo]> = if self.tensors.is_empty() {
            vec![&[]]
        } else {
            self.tensors.chunks(max_tensors_per_part).collect()
        };
        let count = chunks.len();
        let total = self.tensors.len();
        let (Ok(count16), Ok(total32)) = (u16::try_from(count), i32::try_from(total)) else {
            return Err(GgufError::new(
                name,
                ErrorKind::InvalidWrite {
                    detail: format!("{count} parts or {total} tensors are too many for split keys"),
                },
            ));
        };

        let split_keys = [keys::SPLIT_NO, keys::SPLIT_COUNT, keys::SPLIT_TENSORS_COUNT];
        let alignment = self
            .kv_index
            .get(keys::GENERAL_ALIGNMENT)
            .map(|&i| &self.kvs[i].1);
        let split_values: Vec<[Value; 3]> = (0..count)
            .map(|k| {
                [
                    Value::U16(k as u16),
                    Value::U16(count16),
                    Value::I32(total32),
                ]
            })
            .collect();

        let mut written: Vec<(PathBuf, PathBuf)> = Vec::with_capacity(count);
        let mut result = Ok(());
        let mut first_index = 0;
        for (k, chunk) in chunks.iter().enumerate() {
            let path = split_path(&base, k, count);
            let part_name = path.display().to_string();
            let mut kvs: Vec<(&str, &Value)> = if k == 0 {
                self.kvs
                    .iter()
                    .filter(|(key, _)| !split_keys.contains(&key.as_str()))
                    .map(|(key, v)| (key.as_str(), v))
                    .collect()
            } else {
                alignment
                    .map(|v| (keys::GENERAL_ALIGNMENT, v))
                    .into_iter()
                    .collect()
            };
            kvs.extend(split_keys.iter().copied().zip(split_values[k].iter()));
            let tmp = tmp_path(&path);
            result = self.layout(&part_name, &kvs, chunk, k).and_then(|layout| {
                write_file(&tmp, &part_name, |w| {
                    layout.write(w, &part_name, first_index, &mut fill)
                })
            });
            written.push((tmp, path));
            if result.is_err() {
                break;
            }
            first_index += chunk.len();
        }
        if result.is_ok() {
            for (tmp, path) in &written {
                result = rename(tmp, path, &path.display().to_string());
                if result.is_err() {
                    break;
                }
            }
        }
        match result {
            Ok(()) => Ok(written.into_iter().map(|(_, path)| path).collect()),
            Err(e) => {
                for (tmp, _) in &written {
                    let _ = std::fs::remove_file(tmp);
                }
                Err(e)
            }
        }
    }

    /// Encodes the header of a file holding `kvs` and `tensors` and places the tensors.
    fn layout(
        &self,
        file: &str,
        kvs: &[(&str, &Value)],
        tensors: &[TensorInfo],
        part: usize,
    ) -> Result<Layout> {
        let alignment = self.alignment(file)?;
        let mut header = Vec::with_capacity(4096);
        header.extend_from_slice(&GGUF_MAGIC);
        header.extend_from_slice(&self.version.to_le_bytes());
        header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
        for (i, (key, value)) in kvs.iter().enumerate() {
            if key.is_empty() {
                return Err(GgufError::new(
                    file,
                    ErrorKind::EmptyKey { index: i as u64 },
                ));
            }
            check_value(file, key, value)?;
            put_string(&mut header, key);
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, value);
        }
        let mut infos = Vec::with_capacity(tensors.len());
        let mut relative = 0u64;
        for t in tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&relative.to_le_bytes());
            infos.push(TensorInfo {
                part,
                offset: relative,
                ..t.clone()
            });
            relative = align_up(t.n_bytes, alignment)
                .and_then(|p| relative.checked_add(p))
                .ok_or_else(|| {
                    GgufError::new(
                        file,
                        ErrorKind::SizeOverflow {
                            tensor: t.name.clone(),
                            dims: t.dims.clone(),
                        },
                    )
                })?;
        }
        let data_offset = align_up(header.len() as u64, alignment).unwrap_or(u64::MAX);
        for info in &mut infos {
            info.offset += data_offset;
        }
        Ok(Layout {
            header,
            data_offset,
            alignment,
            infos,
        })
    }
}

/// A file's encoded header and the placement of its tensors.
struct Layout {
    header: Vec<u8>,
    data_offset: u64,
    alignment: u64,
    infos: Vec<TensorInfo>,
}

const ZEROS: [u8; 4096] = [0; 4096];

impl Layout {
    /// Streams the file into `w`; tensor `k` of this layout is tensor `first_index + k` for `fill`.
    fn write<W: Write, F>(
        &self,
        mut w: W,
        file: &str,
        first_index: usize,
        fill: &mut F,
    ) -> Result<u64>
    where
        F: FnMut(usize, &TensorInfo, &mut [u8]) -> std::io::Result<()>,
    {
        let io = |source| {
            GgufError::new(
                file,
                ErrorKind::Io {
                    action: "writing",
                    source,
                },
            )
        };
        w.write_all(&self.header).map_err(io)?;
        let mut pos = self.header.len() as u64;
        write_zeros(&mut w, self.data_offset - pos).map_err(io)?;
        pos = self.data_offset;
        let mut buf = Vec::new();
        for (k, info) in self.infos.iter().enumerate() {
            buf.clear();
            // `add_tensor` checked that every size fits in usize.
            buf.resize(info.n_bytes as usize, 0);
            fill(first_index + k, info, &mut buf).map_err(|source| {
                GgufError::new(
                    file,
                    ErrorKind::FillFailed {
                        tensor: info.name.clone(),
                        source,
                    },
                )
            })?;
            w.write_all(&buf).map_err(io)?;
            pos += info.n_bytes;
            let padded = align_up(pos, self.alignment).unwrap_or(pos);
            write_zeros(&mut w, padded - pos).map_err(io)?;
            pos = padded;
        }
        w.flush().map_err(io)?;
        Ok(pos)
    }
}

fn write_zeros<W: Write>(w: &mut W, mut n: u64) -> std::io::Result<()> {
    while n > 0 {
        let k = n.min(ZEROS.len() as u64) as usize;
        w.write_all(&ZEROS[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Creates `tmp`, lets `body` write it through a buffer, and syncs it to disk.
fn write_file(
    tmp: &Path,
    name: &str,
    body: impl FnOnce(&mut BufWriter<File>) -> Result<u64>,
) -> Result<()> {
    let io = |action, source| GgufError::new(name, ErrorKind::Io { action, source });
    let file = File::create(tmp).map_err(|e| io("creating the temporary file", e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    body(&mut w)?;
    let file = w.into_inner().map_err(|e| io("writing", e.into_error()))?;
    file.sync_all().map_err(|e| io("syncing", e))
}

fn rename(tmp: &Path, path: &Path, name: &str) -> Result<()> {
    std::fs::rename(tmp, path).map_err(|source| {
        GgufError::new(
            name,
            ErrorKind::Io {
                action: "renaming the temporary file",
                source,
            },
        )
    })
}

/// Checks what the reader would refuse: oversized strings and arrays, arrays nested too deeply.
fn check_value(file: &str, key: &str, value: &Value) -> Result<()> {
    let too_large = |what: &str, len: usize, limit: u64| {
        Err(GgufError::new(
            file,
            ErrorKind::LengthTooLarge {
                what: format!("{what} of key '{key}'"),
                len: len as u64,
                limit,
            },
        ))
    };
    let check_string = |s: &str| {
        if s.len() as u64 > MAX_STRING_LEN {
            return too_large("a string", s.len(), MAX_STRING_LEN);
        }
        Ok(())
    };
    fn check_array(
        a: &Array,
        check_string: &dyn Fn(&str) -> Result<()>,
        too_large: &dyn Fn(&str, usize, u64) -> Result<()>,
    ) -> Result<()> {
        if a.len() as u64 > MAX_ARRAY_ELEMENTS {
            return too_large("an array", a.len(), MAX_ARRAY_ELEMENTS);
        }
        match a {
            Array::String(v) => v.iter().try_for_each(|s| check_string(s)),
            Array::Array(v) => v
                .iter()
                .try_for_each(|inner| check_array(inner, check_string, too_large)),
            _ => Ok(()),
        }
    }
    check_string(key)?;
    match value {
        Value::String(s) => check_string(s),
        Value::Array(a) if a.depth() > MAX_ARRAY_DEPTH => Err(GgufError::new(
            file,
            ErrorKind::ArrayTooDeep {
                key: key.to_string(),
            },
        )),
        Value::Array(a) => check_array(a, &check_string, &too_large),
        _ => Ok(()),
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A value's payload (what follows its type id).
fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// An array's payload: element type, count, elements (inner arrays without their own `array` tag, as
/// the `gguf` Python package writes them).
fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_string(out, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(out, inner)),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
    }
}
