//! `poly-engine kernels --arch sm_90`: every CUDA kernel module compiled into the kernel cache by NVRTC,
//! without a GPU, so the first model load on a machine (or a container image built without its card)
//! compiles nothing. The cache is `POLY_KERNEL_CACHE`, else `$XDG_CACHE_HOME/polystrata/kernels`, else
//! `~/.cache/polystrata/kernels`; the modules are the default knobs' (`--gpu-prefetch off`).

use super::CliResult;
use clap::Args;
use poly_kernels::cuda::{module, ModuleOrigin};

#[derive(Args)]
pub struct KernelsArgs {
    /// The card's architecture, `sm_` and its compute capability: sm_80 (A100), sm_86, sm_89, sm_90 (H100,
    /// H200), sm_120.
    #[arg(long)]
    arch: String,
}

pub fn run(args: KernelsArgs) -> CliResult {
    let loads = module::fill_cache(&args.arch)?;
    for load in &loads {
        let origin = match load.origin {
            ModuleOrigin::Cached => "cached".to_string(),
            ModuleOrigin::Compiled { seconds, .. } => format!("compiled in {seconds:.1} s"),
        };
        let path = load.path.as_ref().map(|p| p.display().to_string());
        println!(
            "{} {} {origin} {}",
            load.module.name(),
            load.arch,
            path.unwrap_or_default()
        );
    }
    Ok(())
}
