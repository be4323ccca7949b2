//! The decode threads' flags, and how many threads and how much memory they get.

/// The decode threads and what one image may take.
#[derive(clap::Args, Debug, Clone)]
pub struct DecodeFlags {
    /// Largest image in pixels (width × height, read from the header before any pixel
    /// buffer exists). Guards memory against decompression bombs.
    #[arg(
        long,
        env = "VISIONGATE_MAX_IMAGE_PIXELS",
        default_value_t = 100_000_000
    )]
    pub max_image_pixels: u64,

    /// Threads that decode and resize images. 0: with a model instance on a GPU, every
    /// core but one (the GPU needs images faster than a few cores decode them); with CPU
    /// instances only, one per core: they share the cores with the instances, a batch
    /// that is due going before the next image, so every core decodes while the
    /// instances wait for rows and none is split off for either. See `decode_threads`.
    #[arg(long, env = "VISIONGATE_DECODE_THREADS", default_value_t = 0)]
    pub decode_threads: usize,

    /// Memory, in bytes, that all decode threads together may hold for decoded images. A
    /// decode reserves what it needs (estimated from the image's header) and waits while
    /// that is not free; an image that alone needs more is refused (`image_too_large`).
    /// 0: a quarter of the machine's memory, or of the container's limit when lower.
    #[arg(long, env = "VISIONGATE_DECODE_MEMORY_BYTES", default_value_t = 0)]
    pub decode_memory_bytes: u64,

    /// Overrides the preprocessor's `dct_scaling_min_side` parameter: JPEGs decode at
    /// 1/2, 1/4 or 1/8 scale while their short side stays at or above it (0: full size).
    /// Lower is faster on large photos; higher is closer to a full-size decode.
    #[arg(long, env = "VISIONGATE_DCT_SCALING_MIN_SIDE")]
    pub dct_scaling_min_side: Option<u32>,
}

impl DecodeFlags {
    /// `--decode-threads`, `None` for the default (which depends on where the model
    /// instances run: [`decode_threads`]).
    pub fn threads(&self) -> Option<usize> {
        (self.decode_threads > 0).then_some(self.decode_threads)
    }

    /// Bytes of decoded images all decode threads together may hold.
    pub fn memory(&self) -> u64 {
        match self.decode_memory_bytes {
            0 => memory_limit() / 4,
            bytes => bytes,
        }
    }
}

/// The memory this process may use: the machine's, or its container's limit (cgroup v2,
/// else v1) when lower. 4 GiB when neither can be read.
fn memory_limit() -> u64 {
    let read =
        |path: &str| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let kib = text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
            kib.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
                .map(|k| k * 1024)
        });
    // "max" (no limit) does not parse and v1's "no limit" is a huge number: both are
    // passed over by `min`.
    [
        machine,
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(4 << 30)
}

/// The default decode threads on `cores` cores: every core but one when a model instance
/// runs on a GPU (the GPU's forward pass needs little CPU, so decoding is the limit), one
/// per core with CPU instances only (which take the cores they need from the decode
/// threads as batches come due: `cores::Cores`).
pub fn decode_threads(cores: usize, gpu_instances: bool) -> usize {
    if gpu_instances {
        cores.saturating_sub(1).max(1)
    } else {
        cores.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_threads_follow_where_the_instances_run() {
        for (cores, gpu, want) in [
            (1, false, 1),
            (2, false, 2),
            (16, false, 16),
            (1, true, 1),
            (2, true, 1),
            (16, true, 15),
            (64, true, 63),
        ] {
            assert_eq!(decode_threads(cores, gpu), want, "{cores} cores, GPU {gpu}");
        }
    }
}
