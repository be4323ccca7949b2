use clap::Parser;

fn main() -> anyhow::Result<()> {
    limit_malloc_arenas();
    raise_open_file_limit();
    let config = visiongate::config::Config::parse();
    visiongate::telemetry::init(config.log_levels());
    let settings = config.validate().map_err(anyhow::Error::msg)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let shutdown = visiongate::shutdown::on_signals(settings.exit_timeout);
            visiongate::run(settings, shutdown).await
        })
}

/// glibc gives each thread that allocates an arena of its own, up to 8 per core, and
/// each keeps memory freed in it: with many decode threads that held hundreds of MiB
/// resident beyond what the images in flight need. Two arenas, unless `MALLOC_ARENA_MAX`
/// or `GLIBC_TUNABLES` say otherwise. Before any thread starts: glibc fixes the number of
/// arenas when it first needs a second one.
fn limit_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    {
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() && !tunables.contains("arena_max") {
            // SAFETY: mallopt only sets an allocator parameter; no other thread exists yet.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, 2);
            }
        }
    }
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
