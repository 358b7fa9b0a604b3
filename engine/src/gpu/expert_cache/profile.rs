//! The expert profile: how often each routed expert of each layer was chosen, saved beside the model as
//! `<model file>.poly-profile.json` and bound to that file by its size and a hash of its header (metadata
//! and tensor table), so a profile of another file (or an edited one) is never used. The VRAM cache starts
//! from it; the engine adds each answer's routings and saves it again.
//!
//! ```json
//! {"format":1,"file_size":N,"header_hash":"0123456789abcdef","layers":[{"layer":0,"counts":[N,...]},...]}
//! ```

use std::path::{Path, PathBuf};

use poly_models::gguf::GgufFile;
use serde_json::{json, Value};

/// What a profile is bound to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Binding {
    pub file_size: u64,
    pub header_hash: u64,
}

/// FNV-1a 64 of `bytes`.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Binding {
    /// The binding of `file`: its size and the hash of its first part's bytes before the tensor data.
    pub fn of(file: &GgufFile) -> Binding {
        let header = match (file.part_bytes(0), file.data_offset(0)) {
            (Some(b), Some(off)) => &b[..(off as usize).min(b.len())],
            (Some(b), None) => b,
            _ => &[],
        };
        Binding {
            file_size: file.file_bytes(),
            header_hash: fnv1a(header),
        }
    }
}

/// Routing counts per layer (the file's block number) and expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertProfile {
    pub binding: Binding,
    /// `(layer, counts per expert)`, by layer.
    pub layers: Vec<(u32, Vec<u64>)>,
}

/// Where the profile of the model at `model` lives.
pub fn profile_path(model: &Path) -> PathBuf {
    let mut name = model.as_os_str().to_owned();
    name.push(".poly-profile.json");
    PathBuf::from(name)
}

impl ExpertProfile {
    /// An empty profile of `layers` (block number, experts).
    pub fn empty(binding: Binding, layers: &[(u32, usize)]) -> ExpertProfile {
        ExpertProfile {
            binding,
            layers: layers.iter().map(|&(l, n)| (l, vec![0; n])).collect(),
        }
    }

    /// The counts of block `layer`.
    pub fn counts(&self, layer: u32) -> Option<&[u64]> {
        self.layers
            .iter()
            .find(|(l, _)| *l == layer)
            .map(|(_, c)| c.as_slice())
    }

    /// Adds `counts` (same shape as this profile's, by position) to it.
    pub fn add(&mut self, counts: &[Vec<u64>]) {
        for ((_, mine), add) in self.layers.iter_mut().zip(counts) {
            mine.iter_mut()
                .zip(add)
                .for_each(|(a, b)| *a = a.saturating_add(*b));
        }
    }

    /// The JSON text.
    pub fn to_json(&self) -> String {
        json!({
            "format": 1,
            "file_size": self.binding.file_size,
            "header_hash": format!("{:016x}", self.binding.header_hash),
            "layers": self.layers.iter().map(|(l, c)| json!({"layer": l, "counts": c})).collect::<Vec<_>>(),
        })
        .to_string()
    }

    /// Reads `text`; `None` when it is not a profile, or one bound to something other than `binding`, or
    /// its layers are not `layers` (block number, experts).
    pub fn from_json(
        text: &str,
        binding: Binding,
        layers: &[(u32, usize)],
    ) -> Option<ExpertProfile> {
        let v: Value = serde_json::from_str(text).ok()?;
        if v.get("format")?.as_u64()? != 1
            || v.get("file_size")?.as_u64()? != binding.file_size
            || u64::from_str_radix(v.get("header_hash")?.as_str()?, 16).ok()? != binding.header_hash
        {
            return None;
        }
        let mut out = Vec::with_capacity(layers.len());
        let stored = v.get("layers")?.as_array()?;
        for &(layer, n) in layers {
            let entry = stored
                .iter()
                .find(|e| e.get("layer").and_then(Value::as_u64) == Some(u64::from(layer)))?;
            let counts: Vec<u64> = entry
                .get("counts")?
                .as_array()?
                .iter()
                .map(Value::as_u64)
                .collect::<Option<_>>()?;
            if counts.len() != n {
                return None;
            }
            out.push((layer, counts));
        }
        Some(ExpertProfile {
            binding,
            layers: out,
        })
    }

    /// The profile at `path` if it exists and fits (see [`ExpertProfile::from_json`]).
    pub fn load(path: &Path, binding: Binding, layers: &[(u32, usize)]) -> Option<ExpertProfile> {
        let text = std::fs::read_to_string(path).ok()?;
        ExpertProfile::from_json(&text, binding, layers)
    }

    /// Writes it to `path` through a temporary file and a rename (a reader never sees half a profile).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, self.to_json())?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Binding = Binding {
        file_size: 1234,
        header_hash: 0xdead_beef_0042,
    };

    #[test]
    fn round_trip_and_binding() {
        let layers = [(0u32, 3usize), (2, 3)];
        let mut p = ExpertProfile::empty(B, &layers);
        p.add(&[vec![1, 0, 5], vec![0, 7, 0]]);
        p.add(&[vec![1, 0, 0], vec![0, 1, 0]]);
        let text = p.to_json();
        let back = ExpertProfile::from_json(&text, B, &layers).expect("reads back");
        assert_eq!(back, p);
        assert_eq!(back.counts(2), Some(&[0u64, 8, 0][..]));
        let other_size = Binding {
            file_size: 1235,
            ..B
        };
        assert!(ExpertProfile::from_json(&text, other_size, &layers).is_none());
        let other_hash = Binding {
            header_hash: 1,
            ..B
        };
        assert!(ExpertProfile::from_json(&text, other_hash, &layers).is_none());
        assert!(ExpertProfile::from_json(&text, B, &[(0, 4), (2, 3)]).is_none());
        assert!(ExpertProfile::from_json(&text, B, &[(1, 3)]).is_none());
        assert!(ExpertProfile::from_json("{not json", B, &layers).is_none());
    }

    #[test]
    fn save_and_load_beside_the_model() {
        let dir = std::env::temp_dir().join(format!("poly-profile-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let model = dir.join("m.gguf");
        let path = profile_path(&model);
        assert_eq!(path, dir.join("m.gguf.poly-profile.json"));
        let layers = [(5u32, 2usize)];
        let mut p = ExpertProfile::empty(B, &layers);
        p.add(&[vec![3, 4]]);
        p.save(&path).expect("saved");
        assert_eq!(ExpertProfile::load(&path, B, &layers), Some(p));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_hash_sees_every_byte() {
        assert_ne!(fnv1a(b"abc"), fnv1a(b"abd"));
        assert_ne!(fnv1a(b""), fnv1a(b"\0"));
    }
}
