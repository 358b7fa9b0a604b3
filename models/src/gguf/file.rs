//! [`GgufFile`]: a GGUF model opened in place. Every part file is memory-mapped read-only, only the
//! headers are parsed, and tensor views borrow their bytes from the mappings. A split model
//! (`name-00001-of-00003.gguf`, …) is opened whole from any of its parts.
//!
//! Hazard of mapping (the same one ripgrep documents): the mapped bytes belong to the file, not to us. If
//! another process truncates a part file while it is mapped, touching the vanished pages kills the process
//! with SIGBUS; if it rewrites the file, tensor data changes under our feet. Model files are not modified
//! in place in normal use, and copying 20 GB into memory instead is not an option, so we accept the risk
//! and document it: do not truncate or rewrite a model file while a process has it open. (The writer never
//! does: it writes `path.tmp` and renames it, which leaves existing mappings of the old file intact.)

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::{ErrorKind, GgufError};
use super::metadata::{keys, Metadata};
use super::reader::{parse_gguf_bytes, ParsedHeader};
use super::split::{split_path, split_prefix};
use super::{Tensor, TensorInfo};

type Result<T> = std::result::Result<T, GgufError>;

/// Most parts a split model may have (`split.count` is a `u16` in llama.cpp).
const MAX_SPLIT_COUNT: u64 = u16::MAX as u64;

/// A GGUF model (one file, or all parts of a split model), mapped in place.
pub struct GgufFile {
    parts: Vec<Part>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

/// One mapped file.
struct Part {
    path: PathBuf,
    map: Mmap,
    version: u32,
    alignment: u64,
    data_offset: u64,
}

fn path_name(path: &Path) -> String {
    path.display().to_string()
}

/// Maps `path` read-only and parses its header.
fn map_and_parse(path: &Path) -> Result<(Mmap, ParsedHeader)> {
    let name = path_name(path);
    let io = |action, source| GgufError::new(&name, ErrorKind::Io { action, source });
    let file = File::open(path).map_err(|e| io("opening", e))?;
    // SAFETY: the mapping is read-only (PROT_READ), so nothing we do can modify the file through it, and
    // it lives in `Part` next to the slices borrowed from it. What Rust cannot check is the file itself:
    // if another process truncates or rewrites it while mapped, reads fault (SIGBUS) or see changed bytes.
    // We require, and document in this module, that model files are not modified while open.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| io("memory-mapping", e))?;
    let header = parse_gguf_bytes(&map, &name)?;
    Ok((map, header))
}

impl GgufFile {
    /// Opens the GGUF file at `path`. When it is a part of a split model (`split.count` > 1), every part
    /// is opened: the model is the union of the parts' tensors and its metadata is the first part's.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let (map, header) = map_and_parse(path)?;
        let count = header.metadata.get_u64(keys::SPLIT_COUNT)?.unwrap_or(1);
        if count <= 1 {
            return Self::from_parts(vec![(path.to_path_buf(), map, header)], None);
        }
        let name = path_name(path);
        let err = |kind| GgufError::new(&name, kind);
        if count > MAX_SPLIT_COUNT {
            return Err(err(ErrorKind::OutOfRange {
                key: keys::SPLIT_COUNT.into(),
                value: count.to_string(),
            }));
        }
        let count = count as usize;
        let no = header.metadata.get_u64(keys::SPLIT_NO)?.ok_or_else(|| {
            err(ErrorKind::MissingKey {
                key: keys::SPLIT_NO.into(),
            })
        })?;
        if no >= count as u64 {
            return Err(err(ErrorKind::SplitMismatch {
                detail: format!("split.no {no} is not below split.count {count}"),
            }));
        }
        let no = no as usize;
        let Some(prefix) = split_prefix(path, no, count) else {
            return Err(err(ErrorKind::SplitName {
                detail: format!(
                    "part {} of {count} should be named <prefix>{}",
                    no + 1,
                    split_path(Path::new(""), no, count).display()
                ),
            }));
        };

        let mut given = Some((path.to_path_buf(), map, header));
        let mut parts = Vec::with_capacity(count);
        for i in 0..count {
            let part = match given.take_if(|_| i == no) {
                Some(part) => part,
                None => {
                    let part_path = split_path(&prefix, i, count);
                    match map_and_parse(&part_path) {
                        Ok((map, header)) => (part_path, map, header),
                        Err(e) if is_not_found(&e) => {
                            return Err(GgufError::new(
                                path_name(&part_path),
                                ErrorKind::SplitPartMissing { part: i + 1, count },
                            ))
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
            check_split_keys(&part, i, count)?;
            parts.push(part);
        }
        Self::from_parts(parts, Some(count))
    }

    /// Assembles parsed parts; with `split_count`, also checks `split.tensors.count` against the union.
    fn from_parts(
        parsed: Vec<(PathBuf, Mmap, ParsedHeader)>,
        split_count: Option<usize>,
    ) -> Result<GgufFile> {
        let mut parts = Vec::with_capacity(parsed.len());
        let mut metadata = None;
        let mut tensors = Vec::new();
        let mut index = HashMap::new();
        let mut declared_total = None;
        for (k, (path, map, header)) in parsed.into_iter().enumerate() {
            let name = path_name(&path);
            if split_count.is_some() {
                if let Some(n) = header.metadata.get_u64(keys::SPLIT_TENSORS_COUNT)? {
                    if *declared_total.get_or_insert(n) != n {
                        return Err(GgufError::new(
                            name,
                            ErrorKind::SplitMismatch {
                                detail: format!(
                                    "split.tensors.count is {n}, the first part says {}",
                                    declared_total.unwrap_or(n)
                                ),
                            },
                        ));
                    }
                } else if k == 0 {
                    return Err(GgufError::new(
                        name,
                        ErrorKind::MissingKey {
                            key: keys::SPLIT_TENSORS_COUNT.into(),
                        },
                    ));
                }
            }
            for mut info in header.tensors {
                info.part = k;
                if index.insert(info.name.clone(), tensors.len()).is_some() {
                    return Err(GgufError::new(
                        name,
                        ErrorKind::DuplicateTensor { name: info.name },
                    ));
                }
                tensors.push(info);
            }
            if k == 0 {
                metadata = Some(header.metadata);
            }
            parts.push(Part {
                path,
                map,
                version: header.version,
                alignment: header.alignment,
                data_offset: header.data_offset,
            });
        }
        if let Some(declared) = declared_total {
            if declared != tensors.len() as u64 {
                return Err(GgufError::new(
                    path_name(&parts[0].path),
                    ErrorKind::SplitMismatch {
                        detail: format!(
                            "split.tensors.count is {declared} but the parts hold {} tensors",
                            tensors.len()
                        ),
                    },
                ));
            }
        }
        Ok(GgufFile {
            parts,
            metadata: metadata.unwrap_or_default(),
            tensors,
            index,
        })
    }

    /// Checks the counts that size per-layer tables against what the file holds: every block has at least
    /// one tensor, so a `block_count` above the tensor count is a broken file (2^32-1 made readers build
    /// 16 GiB tables and abort). Files without an architecture are not models and pass.
    pub fn check_counts(&self) -> Result<()> {
        let Ok(Some(blocks)) = self.metadata.arch_u64_opt("block_count") else {
            return Ok(());
        };
        if blocks > self.tensors.len() as u64 {
            return Err(GgufError::new(
                self.metadata.source(),
                ErrorKind::OutOfRange {
                    key: self
                        .metadata
                        .arch_key("block_count")
                        .unwrap_or_else(|_| "block_count".into()),
                    value: format!(
                        "{blocks} (more blocks than the file's {} tensors)",
                        self.tensors.len()
                    ),
                },
            ));
        }
        Ok(())
    }

    /// The model's metadata (the first part's, for a split model).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// GGUF version of the first part.
    pub fn version(&self) -> u32 {
        self.parts.first().map_or(0, |p| p.version)
    }

    /// Alignment of the first part's data.
    pub fn alignment(&self) -> u64 {
        self.parts.first().map_or(0, |p| p.alignment)
    }

    /// Where part `part`'s data section starts.
    pub fn data_offset(&self, part: usize) -> Option<u64> {
        self.parts.get(part).map(|p| p.data_offset)
    }

    /// Number of part files (1 unless split).
    pub fn n_parts(&self) -> usize {
        self.parts.len()
    }

    /// The part files, in order.
    pub fn paths(&self) -> Vec<&Path> {
        self.parts.iter().map(|p| p.path.as_path()).collect()
    }

    /// Total size of all part files in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.map.len() as u64).sum()
    }

    /// The whole mapping of part `part` (e.g. to advise the kernel about access patterns).
    pub fn part_bytes(&self, part: usize) -> Option<&[u8]> {
        self.parts.get(part).map(|p| &p.map[..])
    }

    /// Asks the kernel to map every page of every part now, so that the first reads of the weights (the
    /// CPU computing experts the card lacks, say) do not fault page by page: `MADV_POPULATE_READ` (Linux
    /// 5.14 and later; it returns when the pages are mapped), else `MADV_WILLNEED` (read-ahead started in
    /// the background). Reads nothing itself.
    pub fn populate(&self) -> std::io::Result<()> {
        for p in &self.parts {
            #[cfg(target_os = "linux")]
            if p.map.advise(memmap2::Advice::PopulateRead).is_ok() {
                continue;
            }
            p.map.advise(memmap2::Advice::WillNeed)?;
        }
        Ok(())
    }

    /// Number of tensors in all parts.
    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Infos of all tensors: part by part, in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of the tensor `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor `name` with its data, borrowed from the mapping.
    pub fn tensor(&self, name: &str) -> Option<Tensor<'_>> {
        self.view(self.tensor_info(name)?)
    }

    /// All tensors, part by part, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = Tensor<'_>> + '_ {
        self.tensors.iter().filter_map(|info| self.view(info))
    }

    fn view<'a>(&'a self, info: &'a TensorInfo) -> Option<Tensor<'a>> {
        let map = &self.parts.get(info.part)?.map;
        let start = usize::try_from(info.offset).ok()?;
        let end = start.checked_add(usize::try_from(info.n_bytes).ok()?)?;
        // Always present: the parser checked every tensor against its file's length.
        let data = map.get(start..end)?;
        Some(Tensor { info, data })
    }

    // ---- accessors of the metadata, forwarded (see [`Metadata`] for the rest) ----

    /// `general.architecture`; required.
    pub fn architecture(&self) -> Result<&str> {
        self.metadata.architecture()
    }

    /// `general.name`.
    pub fn name(&self) -> Result<Option<&str>> {
        self.metadata.name()
    }

    /// `general.size_label`.
    pub fn size_label(&self) -> Result<Option<&str>> {
        self.metadata.size_label()
    }

    /// `<arch>.<suffix>` as a `u32` (any integer width); required.
    pub fn arch_u32(&self, suffix: &str) -> Result<u32> {
        self.metadata.arch_u32(suffix)
    }

    /// `<arch>.<suffix>` as a `u32`, if present.
    pub fn arch_u32_opt(&self, suffix: &str) -> Result<Option<u32>> {
        self.metadata.arch_u32_opt(suffix)
    }

    /// `<arch>.<suffix>` as an `f32`; required.
    pub fn arch_f32(&self, suffix: &str) -> Result<f32> {
        self.metadata.arch_f32(suffix)
    }

    /// `<arch>.<suffix>` as an `f32`, if present.
    pub fn arch_f32_opt(&self, suffix: &str) -> Result<Option<f32>> {
        self.metadata.arch_f32_opt(suffix)
    }

    /// `<arch>.<suffix>`, an integer array; required.
    pub fn arch_u32_array(&self, suffix: &str) -> Result<Vec<u32>> {
        self.metadata.arch_u32_array(suffix)
    }

    /// `<arch>.<suffix>`, an integer array, if present.
    pub fn arch_u32_array_opt(&self, suffix: &str) -> Result<Option<Vec<u32>>> {
        self.metadata.arch_u32_array_opt(suffix)
    }

    /// `<arch>.<suffix>` per layer (scalar or array of `n_layers`); required.
    pub fn arch_u32_per_layer(&self, suffix: &str, n_layers: usize) -> Result<Vec<u32>> {
        self.metadata.arch_u32_per_layer(suffix, n_layers)
    }

    /// `tokenizer.ggml.model`; required.
    pub fn tokenizer_model(&self) -> Result<&str> {
        self.metadata.tokenizer_model()
    }

    /// `tokenizer.ggml.pre`.
    pub fn tokenizer_pre(&self) -> Result<Option<&str>> {
        self.metadata.tokenizer_pre()
    }

    /// `tokenizer.ggml.tokens`; required.
    pub fn tokenizer_tokens(&self) -> Result<&[String]> {
        self.metadata.tokenizer_tokens()
    }

    /// `tokenizer.ggml.scores`.
    pub fn tokenizer_scores(&self) -> Result<Option<&[f32]>> {
        self.metadata.tokenizer_scores()
    }

    /// `tokenizer.ggml.token_type`.
    pub fn tokenizer_token_types(&self) -> Result<Option<&[i32]>> {
        self.metadata.tokenizer_token_types()
    }

    /// `tokenizer.ggml.merges`.
    pub fn tokenizer_merges(&self) -> Result<Option<&[String]>> {
        self.metadata.tokenizer_merges()
    }

    /// `tokenizer.ggml.bos_token_id`.
    pub fn bos_token_id(&self) -> Result<Option<u32>> {
        self.metadata.bos_token_id()
    }

    /// `tokenizer.ggml.eos_token_id`.
    pub fn eos_token_id(&self) -> Result<Option<u32>> {
        self.metadata.eos_token_id()
    }

    /// `tokenizer.chat_template`.
    pub fn chat_template(&self) -> Result<Option<&str>> {
        self.metadata.chat_template()
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("paths", &self.paths())
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn is_not_found(e: &GgufError) -> bool {
    matches!(e.kind(), ErrorKind::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// Checks that `part` says it is part `i` (0-based) of `count`.
fn check_split_keys(part: &(PathBuf, Mmap, ParsedHeader), i: usize, count: usize) -> Result<()> {
    let (path, _, header) = part;
    let no = header.metadata.get_u64(keys::SPLIT_NO)?;
    let n = header.metadata.get_u64(keys::SPLIT_COUNT)?;
    if no != Some(i as u64) || n != Some(count as u64) {
        return Err(GgufError::new(
            path_name(path),
            ErrorKind::SplitMismatch {
                detail: format!(
                    "expected split.no {i} and split.count {count}, found {} and {}",
                    no.map_or("none".into(), |v| v.to_string()),
                    n.map_or("none".into(), |v| v.to_string()),
                ),
            },
        ));
    }
    Ok(())
}
