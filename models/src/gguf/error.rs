//! Errors of reading and writing GGUF files: every error names the file and the problem.

use std::fmt;

/// The part of a GGUF file a problem was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// Magic, version and the two counts.
    Header,
    /// The key–value pairs.
    Metadata,
    /// The tensor descriptions (name, shape, type, offset).
    TensorInfo,
    /// The padding before the data and the tensor data.
    TensorData,
}

impl fmt::Display for Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Section::Header => "header",
            Section::Metadata => "metadata",
            Section::TensorInfo => "tensor infos",
            Section::TensorData => "tensor data",
        })
    }
}

/// What went wrong; [`GgufError`] adds which file.
#[derive(Debug)]
pub enum ErrorKind {
    /// An operating-system error while `action` (e.g. "opening", "mapping", "writing").
    Io {
        action: &'static str,
        source: std::io::Error,
    },
    /// The file does not start with `GGUF`.
    BadMagic { found: Vec<u8> },
    /// The version field reads as a byte-swapped small number: a big-endian file, which is not supported.
    BigEndian { raw_version: u32 },
    /// Only versions 2 and 3 are read (and written).
    UnsupportedVersion { version: u32 },
    /// The file ends inside `section`: `needed` bytes were wanted at `offset`, the file has `file_len`.
    Truncated {
        section: Section,
        context: String,
        offset: u64,
        needed: u64,
        file_len: u64,
    },
    /// A string or array length above llama.cpp's limit (2^30 bytes or elements), refused before anything
    /// is allocated for it. (Smaller lengths that reach past the end of the file are [`Truncated`].)
    ///
    /// [`Truncated`]: ErrorKind::Truncated
    LengthTooLarge { what: String, len: u64, limit: u64 },
    /// Key number `index` is the empty string.
    EmptyKey { index: u64 },
    /// A key appears twice.
    DuplicateKey { key: String },
    /// A metadata value type id that GGUF does not define.
    UnknownValueType { key: String, id: u32 },
    /// Arrays nested deeper than [`super::MAX_ARRAY_DEPTH`].
    ArrayTooDeep { key: String },
    /// A string that is not UTF-8.
    InvalidUtf8 { what: String },
    /// `general.alignment` is not a `u32` power of two.
    BadAlignment { value: String },
    /// A tensor name of 64 bytes or more (llama.cpp's `GGML_MAX_NAME` limit, including the terminator).
    TensorNameTooLong { name: String, len: usize },
    /// Two tensors (in one file or across the parts of a split model) share a name.
    DuplicateTensor { name: String },
    /// More than 4 dimensions.
    TooManyDims { tensor: String, n_dims: u32 },
    /// A dimension above `i64::MAX` (negative for llama.cpp, which stores them as `int64_t`).
    DimTooLarge { tensor: String, dim: u64 },
    /// The product of the dimensions (or the size in bytes) does not fit in 63 bits.
    SizeOverflow { tensor: String, dims: Vec<u64> },
    /// A tensor type id this crate does not know (removed or newer than our table).
    UnknownTensorType { tensor: String, id: u32 },
    /// The first dimension is not a whole number of blocks of the tensor's type.
    NotBlockMultiple {
        tensor: String,
        ty: &'static str,
        ne0: u64,
        block: u64,
    },
    /// A tensor's data offset is not a multiple of the file's alignment.
    MisalignedOffset {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    /// A tensor's data does not start where the previous one's (padded) data ends; llama.cpp requires the
    /// data section to hold the tensors in order, back to back.
    UnexpectedOffset {
        tensor: String,
        offset: u64,
        expected: u64,
    },
    /// A tensor's data reaches past the end of the file (a truncated or corrupt file).
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    /// A metadata key that an accessor needs is absent.
    MissingKey { key: String },
    /// A metadata value has a type the accessor cannot use.
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    /// A metadata value does not fit the accessor's type (e.g. a negative count).
    OutOfRange { key: String, value: String },
    /// A part of a split model does not follow llama.cpp's `<prefix>-NNNNN-of-NNNNN.gguf` naming.
    SplitName { detail: String },
    /// Part `part` (1-based) of `count` does not exist; the error's file is the missing part's path.
    SplitPartMissing { part: usize, count: usize },
    /// The parts of a split model disagree (`split.no`, `split.count`, `split.tensors.count`).
    SplitMismatch { detail: String },
    /// The writer's fill callback failed for a tensor.
    FillFailed {
        tensor: String,
        source: std::io::Error,
    },
    /// The writer was asked for something GGUF cannot hold (the message says what).
    InvalidWrite { detail: String },
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use ErrorKind::*;
        match self {
            Io { action, source } => write!(f, "I/O error while {action}: {source}"),
            BadMagic { found } => write!(
                f,
                "not a GGUF file (starts with {:?}, expected \"GGUF\")",
                String::from_utf8_lossy(found)
            ),
            BigEndian { raw_version } => write!(
                f,
                "big-endian GGUF files are not supported (version field reads {raw_version:#010x})"
            ),
            UnsupportedVersion { version } => write!(
                f,
                "unsupported GGUF version {version} (versions 2 and 3 are supported{})",
                if *version == 1 { "; version 1 is obsolete" } else { "" }
            ),
            Truncated {
                section,
                context,
                offset,
                needed,
                file_len,
            } => write!(
                f,
                "truncated in the {section} ({context}): {needed} bytes needed at offset {offset}, \
                 but the file is {file_len} bytes long"
            ),
            LengthTooLarge { what, len, limit } => {
                write!(f, "{what} has length {len}, above the limit of {limit}")
            }
            EmptyKey { index } => write!(f, "metadata key #{index} is empty"),
            DuplicateKey { key } => write!(f, "duplicate metadata key '{key}'"),
            UnknownValueType { key, id } => {
                write!(f, "metadata key '{key}' has unknown value type {id}")
            }
            ArrayTooDeep { key } => write!(
                f,
                "metadata key '{key}' nests arrays deeper than {}",
                super::MAX_ARRAY_DEPTH
            ),
            InvalidUtf8 { what } => write!(f, "{what} is not valid UTF-8"),
            BadAlignment { value } => write!(
                f,
                "general.alignment must be a u32 power of two, found {value}"
            ),
            TensorNameTooLong { name, len } => write!(
                f,
                "tensor name '{name}' is {len} bytes long; llama.cpp allows at most 63"
            ),
            DuplicateTensor { name } => write!(f, "duplicate tensor name '{name}'"),
            TooManyDims { tensor, n_dims } => {
                write!(f, "tensor '{tensor}' has {n_dims} dimensions; at most 4 are allowed")
            }
            DimTooLarge { tensor, dim } => {
                write!(f, "tensor '{tensor}' has a dimension of {dim}, above i64::MAX")
            }
            SizeOverflow { tensor, dims } => write!(
                f,
                "tensor '{tensor}' with dimensions {dims:?} has an element count or byte size that \
                 overflows"
            ),
            UnknownTensorType { tensor, id } => {
                write!(f, "tensor '{tensor}' has unknown tensor type id {id}")
            }
            NotBlockMultiple {
                tensor,
                ty,
                ne0,
                block,
            } => write!(
                f,
                "tensor '{tensor}' of type {ty} has {ne0} elements per row, not a multiple of the \
                 block size {block}"
            ),
            MisalignedOffset {
                tensor,
                offset,
                alignment,
            } => write!(
                f,
                "tensor '{tensor}' has data offset {offset}, not a multiple of the alignment {alignment}"
            ),
            UnexpectedOffset {
                tensor,
                offset,
                expected,
            } => write!(
                f,
                "tensor '{tensor}' has data offset {offset}, expected {expected} (tensor data must be \
                 stored in order, back to back)"
            ),
            TensorOutOfBounds {
                tensor,
                start,
                end,
                file_len,
            } => write!(
                f,
                "tensor '{tensor}' occupies bytes {start}..{end} but the file is {file_len} bytes long \
                 (truncated or corrupt)"
            ),
            MissingKey { key } => write!(f, "metadata key '{key}' is missing"),
            WrongType {
                key,
                expected,
                found,
            } => write!(f, "metadata key '{key}' should be {expected}, found {found}"),
            OutOfRange { key, value } => {
                write!(f, "metadata key '{key}' has value {value}, out of range")
            }
            SplitName { detail } => write!(f, "bad split file name: {detail}"),
            SplitPartMissing { part, count } => {
                write!(f, "part {part} of {count} of a split model is missing")
            }
            SplitMismatch { detail } => write!(f, "split parts disagree: {detail}"),
            FillFailed { tensor, source } => {
                write!(f, "filling the data of tensor '{tensor}' failed: {source}")
            }
            InvalidWrite { detail } => write!(f, "cannot write: {detail}"),
        }
    }
}

/// An error about one GGUF file: [`GgufError::file`] names it, [`GgufError::kind`] says what is wrong.
#[derive(Debug)]
pub struct GgufError {
    file: String,
    kind: ErrorKind,
}

impl GgufError {
    /// An error about `file`.
    pub fn new(file: impl Into<String>, kind: ErrorKind) -> Self {
        GgufError {
            file: file.into(),
            kind,
        }
    }

    /// The file (its path, or the name given to [`super::parse_gguf_bytes`]).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// What is wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// Takes the error apart.
    pub fn into_kind(self) -> ErrorKind {
        self.kind
    }
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.file, self.kind)
    }
}

impl std::error::Error for GgufError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            ErrorKind::Io { source, .. } | ErrorKind::FillFailed { source, .. } => Some(source),
            _ => None,
        }
    }
}
