//! Checks shared by the GGUF fuzz targets: what must hold whenever a header parses, and calls of every
//! metadata accessor (which must return errors, never panic, whatever the values).

use poly_models::gguf::{parse_gguf_bytes, GgufWriter, Metadata, ParsedHeader};

/// Invariants of a successfully parsed header of `data`, and a round trip through the writer: writing
/// the same metadata and tensors (with their bytes) gives a file that parses to the same header.
pub fn check_parsed(data: &[u8], h: &ParsedHeader) {
    let mut expected = h.data_offset;
    for t in &h.tensors {
        let end = t.offset.checked_add(t.n_bytes).expect("end fits in u64");
        assert!(end <= data.len() as u64, "tensor inside the input");
        assert_eq!(t.offset, expected, "back to back");
        assert_eq!(t.offset % h.alignment, 0, "aligned");
        assert_eq!(t.ty.bytes_for(t.n_elements()), Some(t.n_bytes));
        assert!(t.dims.len() <= 4 && t.name.len() < 64);
        expected = end.div_ceil(h.alignment) * h.alignment;
    }

    let mut w = GgufWriter::new();
    w.set_version(h.version)
        .expect("parsed version is writable");
    for (k, v) in h.metadata.entries() {
        w.add_kv(k.clone(), v.clone());
    }
    for t in &h.tensors {
        w.add_tensor(t.name.clone(), t.ty, &t.dims)
            .expect("parsed tensor is writable");
    }
    let rewritten = w
        .to_bytes(|i, _, out| {
            let t = &h.tensors[i];
            out.copy_from_slice(&data[t.offset as usize..(t.offset + t.n_bytes) as usize]);
            Ok(())
        })
        .expect("parsed header is writable");
    let h2 = parse_gguf_bytes(&rewritten, "rewritten").expect("rewritten file parses");
    // Debug strings compare NaNs (and keep -0.0 apart from 0.0) as the bits were written.
    assert_eq!(
        format!("{:?}", h.metadata.entries()),
        format!("{:?}", h2.metadata.entries())
    );
    assert_eq!(h.tensors, h2.tensors);
    assert_eq!(
        (h.version, h.alignment, h.data_offset),
        (h2.version, h2.alignment, h2.data_offset)
    );
    for t in &h.tensors {
        let range = t.offset as usize..(t.offset + t.n_bytes) as usize;
        assert_eq!(&data[range.clone()], &rewritten[range]);
    }
}

/// Calls every accessor; results are ignored, only panics matter.
pub fn exercise_accessors(m: &Metadata) {
    let _ = m.architecture();
    let _ = m.name();
    let _ = m.size_label();
    for suffix in [
        "block_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "expert_count",
    ] {
        let _ = m.arch_u32(suffix);
        let _ = m.arch_u32_opt(suffix);
        let _ = m.arch_u64_opt(suffix);
        let _ = m.arch_f32(suffix);
        let _ = m.arch_f32_opt(suffix);
        let _ = m.arch_bool_opt(suffix);
        let _ = m.arch_str_opt(suffix);
        let _ = m.arch_u32_array(suffix);
        let _ = m.arch_f32_array_opt(suffix);
        let _ = m.arch_bool_array_opt(suffix);
        let _ = m.arch_u32_per_layer(suffix, 4);
    }
    let _ = m.tokenizer_model();
    let _ = m.tokenizer_pre();
    let _ = m.tokenizer_tokens();
    let _ = m.tokenizer_scores();
    let _ = m.tokenizer_token_types();
    let _ = m.tokenizer_merges();
    let _ = m.bos_token_id();
    let _ = m.eos_token_id();
    let _ = m.chat_template();
    for (k, _) in m.entries() {
        let _ = m.get_u32(k);
        let _ = m.get_u64(k);
        let _ = m.get_f32(k);
        let _ = m.get_u32_array(k);
        let _ = m.get_f32_array(k);
        let _ = m.get_str_array(k);
        let _ = m.get_u32_per_layer(k, 3);
    }
}
