use clap::Parser;

/// jemalloc for Rust's allocations too (see `visiongate::memory`).
#[cfg(all(feature = "jemalloc", target_os = "linux", target_env = "gnu"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    raise_open_file_limit();
    let config = visiongate::settings::Config::parse();
    if let Err(e) = visiongate::telemetry::init(config.log.levels(), config.log.log_file.as_deref())
    {
        eprintln!("Error: {e}");
        std::process::exit(1);
    }
    if let Err(e) = serve(config) {
        // A start that fails (a port in use, say) may leave models loading on their own
        // threads: exit without the exit-time destructors they could still be using.
        eprintln!("Error: {e:?}");
        visiongate::shutdown::exit_now(1);
    }
}

fn serve(config: visiongate::settings::Config) -> anyhow::Result<()> {
    let settings = config.validate().map_err(anyhow::Error::msg)?;
    // Before any other thread starts: libtorch's CUDA half registers itself as it loads.
    #[cfg(feature = "torch")]
    visiongate::engine::libtorch::cuda_host::cuda_support();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let shutdown = visiongate::shutdown::on_signals(settings.exit_timeout);
            visiongate::run(settings, shutdown).await
        })
}

/// The soft limit on open descriptors up to the hard one, as servers do: connections and
/// registered shared-memory regions (a descriptor each) must not run out at a default
/// soft limit of 1024 while the hard limit allows far more.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads and sets this process's own limit through a valid pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
