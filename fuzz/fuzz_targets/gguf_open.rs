//! Opens arbitrary bytes through the file path (mmap, split handling). Input starting with `S` is a split
//! model of two parts: a little-endian u32 length of part 1, part 1, then part 2, written as
//! `f-00001-of-00002.gguf` and `f-00002-of-00002.gguf`; other input is one file.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use poly_models::gguf::GgufFile;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("poly-fuzz-open-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    let part1 = d.join("f-00001-of-00002.gguf");
    let part2 = d.join("f-00002-of-00002.gguf");
    let single = d.join("f.gguf");
    let open = match data {
        [b'S', l0, l1, l2, l3, rest @ ..] => {
            let len = (u32::from_le_bytes([*l0, *l1, *l2, *l3]) as usize).min(rest.len());
            std::fs::write(&part1, &rest[..len]).expect("write part 1");
            std::fs::write(&part2, &rest[len..]).expect("write part 2");
            &part1
        }
        _ => {
            std::fs::write(&single, data).expect("write file");
            &single
        }
    };
    if let Ok(f) = GgufFile::open(open) {
        let mut total = 0u64;
        for t in f.tensors() {
            assert_eq!(t.data.len() as u64, t.info.n_bytes);
            total += t.data.iter().map(|&b| u64::from(b)).sum::<u64>();
        }
        std::hint::black_box(total);
        assert_eq!(f.tensors().count(), f.n_tensors());
        assert!(f.file_bytes() <= data.len() as u64);
        poly_fuzz::exercise_accessors(f.metadata());
    }
});
