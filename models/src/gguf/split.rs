//! llama.cpp's naming of split models (`gguf-split`): part `i` (0-based) of `n` of the model `prefix` is
//! `<prefix>-<i+1 as 5 digits>-of-<n as 5 digits>.gguf`, and carries `split.no = i`, `split.count = n`,
//! `split.tensors.count = <tensors in all parts>`; only the first part carries the model's metadata.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The file name suffix of part `split_no` (0-based) of `count`.
fn postfix(split_no: usize, count: usize) -> String {
    format!("-{:05}-of-{:05}.gguf", split_no + 1, count)
}

/// The path of part `split_no` (0-based) of `count` of the model `prefix` (llama.cpp's
/// `llama_split_path`): `split_path("dir/m", 0, 3)` is `dir/m-00001-of-00003.gguf`.
pub fn split_path(prefix: &Path, split_no: usize, count: usize) -> PathBuf {
    let mut s = OsString::from(prefix.as_os_str());
    s.push(postfix(split_no, count));
    PathBuf::from(s)
}

/// The prefix of `path` when it is named as part `split_no` (0-based) of `count` (llama.cpp's
/// `llama_split_prefix`); `None` when the name does not end that way or nothing precedes the suffix.
pub fn split_prefix(path: &Path, split_no: usize, count: usize) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(&postfix(split_no, count))?;
    if stem.is_empty() {
        return None;
    }
    Some(path.with_file_name(stem))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_cpp() {
        let p = split_path(Path::new("/m/qwen"), 1, 3);
        assert_eq!(p, Path::new("/m/qwen-00002-of-00003.gguf"));
        assert_eq!(split_prefix(&p, 1, 3), Some(PathBuf::from("/m/qwen")));
        assert_eq!(split_prefix(&p, 0, 3), None);
        assert_eq!(split_prefix(Path::new("-00001-of-00002.gguf"), 0, 2), None);
        assert_eq!(
            split_prefix(Path::new("a-00001-of-00002.gguf"), 0, 2),
            Some(PathBuf::from("a"))
        );
    }
}
