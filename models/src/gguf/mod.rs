//! The GGUF file format (llama.cpp's model files), versions 2 and 3, little-endian.
//!
//! Layout of one file: magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata count, the
//! key–value pairs, the tensor infos (name, dims with `ne0` first, type id, offset relative to the data
//! section), padding to the alignment (`general.alignment`, default 32), then the tensor data, each tensor
//! aligned and stored in order.
//!
//! - [`reader`]: [`parse_gguf_bytes`] parses and validates a header from a byte slice (what the fuzz
//!   target calls).
//! - [`file`]: [`GgufFile`] memory-maps a file (and every part of a split model) and hands out tensor views
//!   that borrow the mapping; nothing is copied.
//! - [`metadata`]: [`Metadata`], ordered key–value pairs with typed accessors (architecture,
//!   hyperparameters, tokenizer, chat template).
//! - [`value`]: [`Value`] and typed [`Array`]s.
//! - [`writer`]: [`GgufWriter`], which streams a file (or split parts) tensor by tensor.
//! - [`split`]: llama.cpp's split file naming (`name-00001-of-00003.gguf`).
//! - [`error`]: [`GgufError`], which names the file and the problem.

pub mod error;
pub mod file;
pub mod metadata;
pub mod reader;
pub mod split;
pub mod value;
pub mod writer;

pub use error::{ErrorKind, GgufError, Section};
pub use file::GgufFile;
pub use metadata::{keys, Metadata};
pub use reader::{parse_gguf_bytes, ParsedHeader};
pub use split::{split_path, split_prefix};
pub use value::{Array, Value, ValueType};
pub use writer::GgufWriter;

use poly_kernels::GgmlType;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Tensor names must be shorter than this many bytes (`GGML_MAX_NAME`, which counts the terminator).
pub const MAX_TENSOR_NAME_LEN: usize = 64;
/// Longest string llama.cpp reads (`GGUF_MAX_STRING_LENGTH`).
pub const MAX_STRING_LEN: u64 = 1 << 30;
/// Most elements of an array llama.cpp reads (`GGUF_MAX_ARRAY_ELEMENTS`).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 30;
/// How deeply arrays of arrays may nest (llama.cpp reads none; the `gguf` Python package any): a bound so
/// hostile input cannot recurse without limit.
pub const MAX_ARRAY_DEPTH: usize = 16;

/// Where one tensor is and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Its GGML type.
    pub ty: GgmlType,
    /// Dimensions as stored: `ne0` (the contiguous row length) first.
    pub dims: Vec<u64>,
    /// Which part file of a split model holds it (0 for single files).
    pub part: usize,
    /// Absolute offset of its data in its part file.
    pub offset: u64,
    /// Size of its data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (1 for a tensor of no dimensions, 0 when a dimension is 0).
    pub fn n_elements(&self) -> u64 {
        // Validated when read (or added to a writer) to fit in 63 bits.
        self.dims.iter().product()
    }

    /// Length of a row (`ne0`); 1 for a tensor of no dimensions.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: elements / `ne0` (0 when `ne0` is 0).
    pub fn n_rows(&self) -> u64 {
        self.n_elements().checked_div(self.row_len()).unwrap_or(0)
    }
}

/// A tensor of a mapped file: its info and its bytes, borrowed from the mapping.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    /// Name, type, shape and location.
    pub info: &'a TensorInfo,
    /// The data, exactly `info.n_bytes` long.
    pub data: &'a [u8],
}

impl<'a> Tensor<'a> {
    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    /// The tensor's type.
    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }

    /// Dimensions, `ne0` first.
    pub fn dims(&self) -> &'a [u64] {
        &self.info.dims
    }
}
