//! `poly-engine encode-image`: encodes a picture with a vision projector (`mmproj`) file on the CPU and
//! prints the rows' shape and a checksum (and writes the rows as little-endian f32 with `--out`).

use super::CliResult;
use clap::Args;
use poly_models::vision::picture::decode;
use poly_models::vision::{ImageRows, VisionEncoder};
use poly_models::GgufFile;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct EncodeImageArgs {
    /// The projector file (`clip.projector_type` qwen3vl_merger or gemma4v).
    #[arg(long)]
    mmproj: PathBuf,
    /// The picture: PNG, JPEG or WebP.
    #[arg(long)]
    image: PathBuf,
    /// Fewest output rows the picture is resized to (mtmd's `--image-min-tokens`; default: the projector
    /// type's, 8 for qwen3vl_merger, 70 for gemma4v).
    #[arg(long)]
    min_tokens: Option<usize>,
    /// Most output rows the picture is resized to (mtmd's `--image-max-tokens`; default: the projector
    /// type's, 4096 for qwen3vl_merger, 1120 for gemma4v).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Write the rows here, row after row, as little-endian f32.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the resized, normalized picture here (f32 RGB interleaved, row-major, little-endian): what
    /// the witness's `VISION_ROWS_PICTURE` writes from mtmd's preprocessor.
    #[arg(long)]
    dump_picture: Option<PathBuf>,
}

/// Sum, root mean square and an order-sensitive digest of the rows' f32 bits (FNV-1a).
fn checksum(rows: &ImageRows) -> (f64, f64, u64) {
    let sum: f64 = rows.values.iter().map(|&v| v as f64).sum();
    let sq: f64 = rows.values.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let rms = (sq / rows.values.len().max(1) as f64).sqrt();
    let digest = rows.values.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        v.to_bits()
            .to_le_bytes()
            .iter()
            .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
    });
    (sum, rms, digest)
}

pub fn run(args: EncodeImageArgs) -> CliResult {
    let file = GgufFile::open(&args.mmproj)?;
    let encoder = VisionEncoder::load(&file)?;
    let bytes =
        std::fs::read(&args.image).map_err(|e| format!("reading {}: {e}", args.image.display()))?;
    let picture = decode(&bytes)?;
    let start = Instant::now();
    let defaults = encoder.default_token_limits();
    let tokens = (
        args.min_tokens.unwrap_or(defaults.0),
        args.max_tokens.unwrap_or(defaults.1),
    );
    let prepared = encoder.prepare(&picture, tokens);
    let rows = encoder.encode(&prepared)?;
    let seconds = start.elapsed().as_secs_f64();
    let (sum, rms, digest) = checksum(&rows);
    println!(
        "{{\"picture\":[{},{}],\"resized\":[{},{}],\"grid\":[{},{}],\"rows\":{},\"width\":{},\"sum\":{sum:.6},\"rms\":{rms:.6},\"fnv1a\":\"{digest:016x}\",\"seconds\":{seconds:.3}}}",
        picture.width,
        picture.height,
        prepared.width,
        prepared.height,
        rows.n_x,
        rows.n_y,
        rows.n_rows(),
        rows.width,
    );
    if let Some(path) = &args.dump_picture {
        let data: Vec<u8> = prepared
            .values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(path, data).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(out) = &args.out {
        let data: Vec<u8> = rows.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out, data).map_err(|e| format!("writing {}: {e}", out.display()))?;
    }
    Ok(())
}
