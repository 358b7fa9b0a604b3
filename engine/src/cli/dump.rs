//! `poly-engine dump FILE TENSOR OUT`: one tensor, dequantized to little-endian f32 in GGUF order (ne0
//! fastest), so any tool can check our reading of it.

use super::CliResult;
use clap::Args;
use poly_kernels::quant::dequantize;
use poly_models::GgufFile;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct DumpArgs {
    /// The GGUF file (any part of a split model).
    file: PathBuf,
    /// The tensor's name, e.g. `blk.0.ffn_down_exps.weight`.
    tensor: String,
    /// Where to write the f32 values (`-` for stdout).
    out: PathBuf,
}

/// Rows dequantized per write, so a multi-GB tensor never needs its f32 copy in memory at once.
const ROWS_PER_CHUNK: u64 = 1024;

pub fn run(args: DumpArgs) -> CliResult {
    let file = GgufFile::open(&args.file)?;
    let tensor = file.tensor(&args.tensor).ok_or_else(|| {
        format!(
            "{}: no tensor named {:?} ({} tensors; `poly-engine inspect` lists them)",
            args.file.display(),
            args.tensor,
            file.n_tensors()
        )
    })?;
    let ty = tensor.ty();
    let row_len = tensor.info.row_len();
    let row_bytes = ty.bytes_for(row_len).ok_or_else(|| {
        format!(
            "{}: rows of {row_len} are not whole {ty} blocks",
            args.tensor
        )
    })?;
    let mut out: Box<dyn Write> = if args.out.as_os_str() == "-" {
        Box::new(std::io::BufWriter::new(std::io::stdout().lock()))
    } else {
        Box::new(std::io::BufWriter::new(
            std::fs::File::create(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?,
        ))
    };
    let n_rows = tensor.info.n_rows();
    let mut values = Vec::new();
    let mut bytes = Vec::new();
    let mut first = 0u64;
    while first < n_rows {
        let rows = ROWS_PER_CHUNK.min(n_rows - first);
        let src = &tensor.data[(first * row_bytes) as usize..((first + rows) * row_bytes) as usize];
        values.resize((rows * row_len) as usize, 0f32);
        dequantize(ty, src, &mut values)?;
        bytes.clear();
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        out.write_all(&bytes)?;
        first += rows;
    }
    out.flush()?;
    eprintln!(
        "{}: {} values of {} ({ty}, dims {:?}) written",
        args.out.display(),
        n_rows * row_len,
        args.tensor,
        tensor.dims()
    );
    Ok(())
}
