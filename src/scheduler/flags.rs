//! What every model's queue and the response cache get.
use crate::config;

/// What every model's queue gets unless its config says otherwise, and the response cache.
#[derive(clap::Args, Debug, Clone)]
pub struct QueueFlags {
    /// Requests that may wait in a model's queue when its config.pbtxt sets no
    /// `default_queue_policy.max_queue_size`. One more is refused at once with 503.
    #[arg(long, env = "VISIONGATE_MAX_QUEUE_SIZE", default_value_t = 256)]
    pub max_queue_size: usize,

    /// Response cache size in bytes, shared by the models whose config.pbtxt has
    /// `response_cache { enable: true }`. An entry (one image's answer) takes about 200
    /// bytes; least recently used leave first. Triton's `--cache-config local,size=N`
    /// and `--response-cache-byte-size N` set it too.
    #[arg(long, env = "VISIONGATE_CACHE_SIZE", default_value_t = 64 << 20)]
    pub cache_size: usize,

    /// Triton's `--cache-config <cache>,<setting>=<value>` (repeatable): `local,size=N`
    /// sets the response cache's size (the only cache here).
    #[arg(long, action = clap::ArgAction::Append)]
    pub cache_config: Vec<String>,

    /// Triton's older `--response-cache-byte-size N`: `--cache-config local,size=N`.
    #[arg(long)]
    pub response_cache_byte_size: Option<u64>,
}

impl QueueFlags {
    /// `--max-queue-size`.
    pub fn max_queue_size(&self) -> Result<usize, String> {
        match self.max_queue_size {
            0 => Err("--max-queue-size must be at least 1".into()),
            n => Ok(n),
        }
    }

    /// The response cache's bytes: `--cache-size`, or Triton's cache flags when given.
    pub fn cache_bytes(&self) -> Result<usize, String> {
        Ok(
            config::cache_size(&self.cache_config, self.response_cache_byte_size)?
                .unwrap_or(self.cache_size),
        )
    }
}
