//! The differential check of the JPEG decoder against stb_image on many random files, run by
//! `tests/witness/jpeg_stb_diff.sh` (which writes them and stb's answers; needs Pillow, cjpeg, g++ and
//! the pinned llama.cpp): `JPEG_STB_DIFF=DIR cargo test -p poly-models --test jpeg_stb_diff -- --ignored`.
//! DIR holds `stb.txt` (`NAME WIDTH HEIGHT` or `NAME refused`), `set/NAME.jpg` and `stbout/NAME.rgb`.
//! Every file stb decodes must decode to its bytes, except where this refuses a JPEG with no scan
//! (stb hands back memory it never wrote); every file stb refuses must be refused.

#[test]
#[ignore = "needs the files tests/witness/jpeg_stb_diff.sh writes (JPEG_STB_DIFF=DIR)"]
fn random_jpegs_decode_as_stb_decodes_them() {
    let dir =
        std::env::var("JPEG_STB_DIFF").expect("JPEG_STB_DIFF=DIR (tests/witness/jpeg_stb_diff.sh)");
    let list = std::fs::read_to_string(format!("{dir}/stb.txt")).expect("stb.txt");
    let (mut same, mut refused, mut no_scan) = (0, 0, 0);
    let mut wrong = Vec::new();
    for line in list.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let bytes = std::fs::read(format!("{dir}/set/{}.jpg", f[0])).expect("jpg");
        let got = poly_models::vision::jpeg::decode(&bytes);
        if f[1] == "refused" {
            match got {
                Err(_) => refused += 1,
                Ok(_) => wrong.push(format!("{}: stb refuses it, decoded here", f[0])),
            }
            continue;
        }
        let want = std::fs::read(format!("{dir}/stbout/{}.rgb", f[0])).expect("rgb");
        match got {
            Ok(p) if p.pixels == want => same += 1,
            Ok(p) => {
                let n = p.pixels.iter().zip(&want).filter(|(a, b)| a != b).count();
                wrong.push(format!("{}: {n} of {} bytes differ", f[0], want.len()));
            }
            Err(e) if e.contains("no image data") => no_scan += 1,
            Err(e) => wrong.push(format!("{}: stb decodes it, refused here: {e}", f[0])),
        }
    }
    eprintln!("{same} equal, {refused} refused by both, {no_scan} without a scan refused here");
    assert!(same > 0, "nothing compared");
    assert!(
        wrong.is_empty(),
        "{} differ:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
