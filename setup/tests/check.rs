//! `setup --check` with given VRAM/RAM figures: each line's class (whole in VRAM, a share of the experts in
//! VRAM, on the CPU from RAM, needs more RAM) and its percentage, for a table with round figures and for
//! the built-in table; an installed model is measured from its GGUF. Under a second.

mod common;

use common::{setup_bin, TempDir};
use poly_setup::check::{assess, Fit, Machine, Needs, WORKING_MEMORY};
use poly_setup::families::FamilyTable;
use serde_json::json;
use std::path::Path;
use std::process::Command;

const MIB: u64 = 1 << 20;

fn check(args: &[&str]) -> String {
    let out = Command::new(setup_bin())
        .arg("--check")
        .args(args)
        .output()
        .expect("run setup --check");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn line<'a>(text: &'a str, name: &str) -> &'a str {
    text.lines()
        .find(|l| l.contains(&format!("{name} (")) || l.starts_with(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no line for {name} in:\n{text}"))
}

/// A table with one size of 10,000 MiB: 8,000 MiB of experts, 3,000 MiB of VRAM before them.
fn round_table(dir: &Path) -> String {
    let t = json!({"families": [{
        "name": "moe", "display": "MoE", "arch": "qwen3moe", "default_context": 512,
        "sizes": [{"name": "Q", "source": {"hugging_face": {"repo": "t/moe", "revision": null}},
            "files": [{"path": "moe.gguf", "bytes": 10_000 * MIB}],
            "expert_bytes": 8_000 * MIB, "vram_before_experts": 3_000 * MIB}]
    }, {
        "name": "later", "display": "Later", "arch": "gemma4", "default_context": 512,
        "not_runnable": "architecture gemma4 is not run by the engine yet", "sizes": []
    }]});
    let path = dir.join("families.json");
    std::fs::write(&path, t.to_string()).expect("write");
    path.to_string_lossy().into_owned()
}

#[test]
fn lines_classify_by_the_given_figures() {
    let tmp = TempDir::new("check");
    let families = round_table(tmp.path());
    let home = tmp.path().join("home");
    let home = home.to_string_lossy();
    let base = ["--families", families.as_str(), "--home", &home];
    let run = |vram: &str, ram: &str| {
        let mut args = base.to_vec();
        args.extend(["--vram-mib", vram, "--ram-mib", ram]);
        check(&args)
    };
    // 11,000 MiB of VRAM hold the 3,000 before experts and all 8,000 of experts.
    let out = run("11000", "16000");
    assert!(line(&out, "moe Q").contains("runs whole in VRAM"), "{out}");
    assert!(
        line(&out, "moe Q").starts_with("estimate: "),
        "labelled: {out}"
    );
    // 5,000 MiB: 2,000 of the 8,000 MiB of experts = 25%.
    let out = run("5000", "16000");
    assert!(
        line(&out, "moe Q").contains("about 25% of its experts in VRAM, the rest from RAM"),
        "{out}"
    );
    // The same card, but RAM below the 6,000 MiB of experts left plus working memory.
    let out = run("5000", "2000");
    let short = 6_000 * MIB + WORKING_MEMORY - 2_000 * MIB;
    assert!(
        line(&out, "moe Q").contains(&format!(
            "needs about {:.1} GB more RAM",
            short as f64 / 1e9
        )),
        "{out}"
    );
    // No GPU: the whole file from RAM.
    let out = run("0", "16000");
    assert!(
        line(&out, "moe Q").contains("runs on the CPU from RAM (no GPU)"),
        "{out}"
    );
    assert!(
        out.starts_with("this PC: ") && out.contains("no GPU"),
        "{out}"
    );
    // A card too small for the dense part: the CPU.
    let out = run("2000", "16000");
    assert!(line(&out, "moe Q").contains("card is too small"), "{out}");
    // Families the engine cannot run say so.
    assert!(line(&out, "later").contains("not runnable yet"), "{out}");
}

#[test]
fn the_builtin_table_is_assessed_and_an_installed_model_is_measured() {
    let table = FamilyTable::builtin().expect("built-in table");
    let tmp = TempDir::new("builtin");
    let home = tmp.path().join("home");
    std::fs::create_dir_all(home.join("models")).expect("home");
    let gguf = home.join("models/tiny.gguf");
    std::fs::copy(common::fixture_gguf(), &gguf).expect("copy");
    std::fs::write(
        home.join("strata-tiny.json"),
        json!({"exe": "/bin/true", "args": ["--model", "models/tiny.gguf"]}).to_string(),
    )
    .expect("config");
    let home_s = home.to_string_lossy();
    let out = check(&[
        "--home",
        &home_s,
        "--vram-mib",
        "8192",
        "--ram-mib",
        "32768",
    ]);
    let machine = Machine {
        vram_bytes: Some(8192 * MIB),
        ram_bytes: 32768 * MIB,
    };
    // Every runnable size with figures gets a line whose verdict is the library's for those figures.
    for family in table.families.iter().filter(|f| f.is_runnable()) {
        for size in &family.sizes {
            let name = format!("{} {}", family.name, size.name);
            let needs = Needs {
                file_bytes: size.model_bytes().expect("size known"),
                expert_bytes: size.expert_bytes.expect("experts known"),
                vram_before_experts: size.vram_before_experts.expect("vram known"),
            };
            let verdict = assess(&needs, &machine).to_string();
            assert!(
                line(&out, &name).ends_with(&verdict),
                "{name}: {verdict}\n{out}"
            );
        }
    }
    // The demo is dense and small: whole in an 8 GiB card.
    assert!(
        line(&out, "demo Q4_1").contains("runs whole in VRAM"),
        "{out}"
    );
    // A 35B-A3B size does not fit 8 GiB whole: a share of its experts.
    assert!(
        line(&out, "qwen36 UD-Q3_K_M").contains("% of its experts in VRAM"),
        "{out}"
    );
    assert!(
        line(&out, "deepseek UD-IQ1_M").contains("not runnable yet"),
        "{out}"
    );
    // The installed model: its GGUF read (dense, 2.5 MB) and assessed.
    assert!(
        line(&out, "installed tiny").contains("runs whole in VRAM"),
        "{out}"
    );
}

#[test]
fn assess_covers_each_class() {
    let gb = 1_000_000_000u64;
    let needs = Needs {
        file_bytes: 20 * gb,
        expert_bytes: 17 * gb,
        vram_before_experts: 4 * gb,
    };
    let m = |vram: Option<u64>, ram: u64| Machine {
        vram_bytes: vram,
        ram_bytes: ram,
    };
    assert_eq!(assess(&needs, &m(Some(21 * gb), 8 * gb)), Fit::WholeInVram);
    // 12 GB: 8 of 17 GB of experts = 47%; 9 GB from RAM + 1 GB working memory fits 16 GB.
    assert_eq!(
        assess(&needs, &m(Some(12 * gb), 16 * gb)),
        Fit::PartlyInVram { percent: 47 }
    );
    assert_eq!(
        assess(&needs, &m(Some(12 * gb), 8 * gb)),
        Fit::NeedsMoreRam {
            short_bytes: 2 * gb
        }
    );
    assert_eq!(
        assess(&needs, &m(None, 32 * gb)),
        Fit::CpuFromRam { has_gpu: false }
    );
    assert_eq!(
        assess(&needs, &m(None, 16 * gb)),
        Fit::NeedsMoreRam {
            short_bytes: 5 * gb
        }
    );
}

#[test]
fn the_default_size_is_the_first_unless_ram_is_short_then_the_smallest() {
    let gb = 1_000_000_000u64;
    let t = json!({"families": [{
    "name": "f", "display": "F", "arch": "qwen35moe", "default_context": 512,
    "sizes": [
        {"name": "mid", "source": {"hugging_face": {"repo": "t/f", "revision": null}},
         "files": [{"path": "mid.gguf", "approx_bytes": 16 * gb}], "expert_bytes": null, "vram_before_experts": null},
        {"name": "small", "source": {"hugging_face": {"repo": "t/f", "revision": null}},
         "files": [{"path": "small.gguf", "approx_bytes": 12 * gb}], "expert_bytes": null, "vram_before_experts": null},
        {"name": "big", "source": {"hugging_face": {"repo": "t/f", "revision": null}},
         "files": [{"path": "big.gguf", "approx_bytes": 22 * gb}], "expert_bytes": null, "vram_before_experts": null}
    ]}]});
    let table = FamilyTable::parse(&t.to_string(), "test table").expect("table");
    let family = table.family("f").expect("family");
    let pick = |ram: Option<u64>| family.default_size(ram).expect("size").name.clone();
    assert_eq!(pick(Some(32 * gb)), "mid");
    assert_eq!(
        pick(Some(17 * gb)),
        "mid",
        "16 GB + 1 GB working memory fit"
    );
    assert_eq!(pick(Some(16 * gb)), "small");
    assert_eq!(pick(None), "mid", "RAM unknown: the first");
}
