//! `poly-engine inspect FILE [--json]`: the facts of a model file, the same the model registry shows.

use super::CliResult;
use clap::Args;
use poly_models::gguf::GgufFile;
use poly_models::summary::{short_value, ModelSummary};
use serde_json::json;
use std::path::PathBuf;

#[derive(Args)]
pub struct InspectArgs {
    /// The GGUF file (any part of a split model).
    file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also list every tensor (name, type, dims, bytes).
    #[arg(long)]
    tensors: bool,
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

pub fn run(args: InspectArgs) -> CliResult {
    let file = GgufFile::open(&args.file)?;
    let s = ModelSummary::of(&file)?;
    if args.json {
        let types: serde_json::Map<String, serde_json::Value> = s
            .types
            .iter()
            .map(|(t, share)| {
                (
                    t.name().to_string(),
                    json!({"tensors": share.tensors, "bytes": share.bytes}),
                )
            })
            .collect();
        let mut v = json!({
            "path": args.file,
            "architecture": s.architecture,
            "name": s.name,
            "size_label": s.size_label,
            "file_bytes": s.file_bytes,
            "parts": s.n_parts,
            "gguf_version": s.gguf_version,
            "metadata_count": s.n_metadata,
            "tensor_count": s.n_tensors,
            "parameters": s.n_elements,
            "block_count": s.block_count,
            "context_length": s.context_length,
            "embedding_length": s.embedding_length,
            "types": types,
            "expert_bytes": s.expert_bytes,
            "other_bytes": s.other_bytes,
            "expert_count": s.n_experts,
            "expert_used_count": s.n_experts_used,
            "expert_type": s.expert_type.map(|t| t.name()),
            "main_type": s.main_type.map(|t| t.name()),
            "mtp": s.has_mtp,
            "chat_template": s.chat_template,
            "tokenizer_model": s.tokenizer_model,
            "vocab_size": s.vocab_size,
        });
        if args.tensors {
            v["tensors"] = file
                .tensor_infos()
                .iter()
                .map(|t| json!({"name": t.name, "type": t.ty.name(), "dims": t.dims, "bytes": t.n_bytes}))
                .collect();
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }

    println!(
        "file          {} ({} part(s), GGUF v{})",
        args.file.display(),
        s.n_parts,
        s.gguf_version
    );
    println!("architecture  {}", s.architecture);
    println!("name          {}", s.name.as_deref().unwrap_or("-"));
    println!("size label    {}", s.size_label.as_deref().unwrap_or("-"));
    println!(
        "size          {} ({} bytes), {} parameters",
        gib(s.file_bytes),
        s.file_bytes,
        s.n_elements
    );
    println!("tensors       {}", s.n_tensors);
    match s.n_experts {
        Some(n) => println!(
            "experts       {n} routed per layer, {} used per token, mostly {}",
            s.n_experts_used.map_or("?".to_string(), |u| u.to_string()),
            s.expert_type.map_or("-", |t| t.name())
        ),
        None => println!("experts       none (dense)"),
    }
    println!(
        "expert bytes  {} ({} bytes)",
        gib(s.expert_bytes),
        s.expert_bytes
    );
    println!(
        "other bytes   {} ({} bytes)",
        gib(s.other_bytes),
        s.other_bytes
    );
    println!("tensor types:");
    for (ty, share) in &s.types {
        println!(
            "  {:8} {:5} tensors  {:>12} bytes",
            ty.name(),
            share.tensors,
            share.bytes
        );
    }
    println!("metadata ({} keys):", s.n_metadata);
    for (key, value) in file.metadata().entries() {
        println!("  {key} = {}", short_value(value));
    }
    if args.tensors {
        println!("tensor list:");
        for t in file.tensor_infos() {
            println!(
                "  {:40} {:8} {:?} {} bytes",
                t.name,
                t.ty.name(),
                t.dims,
                t.n_bytes
            );
        }
    }
    Ok(())
}
