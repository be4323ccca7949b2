//! Triton's response cache, per image: a row's output is kept under a hash of the
//! preprocessed u8 row, the model, its version, the normalization and what the caller
//! asked for (top-k size, logits), so a repeated photo skips the model. Bounded in bytes,
//! least recently used out first. One cache is shared by every model that enables it,
//! as Triton's `--cache-config local,size=...` is.
use std::sync::Mutex;

use lru::LruCache;
use xxhash_rust::xxh3::Xxh3;

use super::{RowFormat, RowOutput};
use crate::engine::OutputRequest;
use crate::preprocess::Row;

/// 128-bit xxh3 of everything that decides a row's output; a collision among 2^64 keys
/// is far less likely than a bit flip in memory, so the row itself is not stored.
pub type CacheKey = u128;

pub struct ResponseCache {
    capacity_bytes: usize,
    inner: Mutex<Entries>,
}

impl std::fmt::Debug for ResponseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseCache")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("bytes", &self.bytes())
            .finish()
    }
}

struct Entries {
    lru: LruCache<CacheKey, RowOutput>,
    bytes: usize,
}

impl ResponseCache {
    pub fn new(capacity_bytes: usize) -> Self {
        ResponseCache {
            capacity_bytes,
            inner: Mutex::new(Entries {
                lru: LruCache::unbounded(),
                bytes: 0,
            }),
        }
    }

    /// `generation` tells loads of the same model version apart (a reload may bring new
    /// weights under the same version number).
    pub fn key(
        model: &str,
        version: u64,
        generation: u64,
        format: &RowFormat,
        want: OutputRequest,
        row: &Row,
    ) -> CacheKey {
        let mut h = Xxh3::new();
        h.update(&(model.len() as u64).to_le_bytes());
        h.update(model.as_bytes());
        h.update(&version.to_le_bytes());
        h.update(&generation.to_le_bytes());
        match format {
            RowFormat::Image(n) => {
                h.update(&[0]);
                for v in n.mean.iter().chain(&n.std) {
                    h.update(&v.to_bits().to_le_bytes());
                }
            }
            RowFormat::TensorF32 => h.update(&[1]),
        }
        h.update(&(want.top_k.get() as u64).to_le_bytes());
        h.update(&[u8::from(want.logits)]);
        match row {
            Row::Bytes(bytes) => {
                h.update(&[0]);
                h.update(bytes);
            }
            // Encoded: its output also depends on how the preprocessor makes its row.
            Row::Jpeg(jpeg) => {
                let s = &jpeg.settings;
                h.update(&[1]);
                for v in [s.width, s.height, s.dct_scaling_min_side, s.filter as u32] {
                    h.update(&v.to_le_bytes());
                }
                h.update(&jpeg.bytes);
            }
        }
        h.digest128()
    }

    /// Bytes an entry is charged: its key, its output and the map's bookkeeping.
    fn entry_bytes(out: &RowOutput) -> usize {
        const OVERHEAD: usize = 64;
        std::mem::size_of::<CacheKey>()
            + std::mem::size_of::<RowOutput>()
            + std::mem::size_of_val(out.top.classes())
            + out.logits.as_ref().map_or(0, |l| l.len() * 4)
            + OVERHEAD
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // Entries stay consistent across a panic (every update is a single map call plus
        // a byte count), so a poisoned lock is recovered.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached output for `key`, marking it most recently used.
    pub fn get(&self, key: CacheKey) -> Option<RowOutput> {
        self.lock().lru.get(&key).cloned()
    }

    /// Stores `out`, evicting the least recently used entries until it fits. An entry
    /// larger than the whole cache is not stored.
    pub fn insert(&self, key: CacheKey, out: RowOutput) {
        let size = Self::entry_bytes(&out);
        if size > self.capacity_bytes {
            return;
        }
        let mut e = self.lock();
        if let Some(old) = e.lru.pop(&key) {
            e.bytes -= Self::entry_bytes(&old);
        }
        while e.bytes + size > self.capacity_bytes {
            let Some((_, old)) = e.lru.pop_lru() else {
                break;
            };
            e.bytes -= Self::entry_bytes(&old);
        }
        e.bytes += size;
        e.lru.put(key, out);
    }

    pub fn len(&self) -> usize {
        self.lock().lru.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(class: u32) -> RowOutput {
        RowOutput {
            top: Ranked::new(vec![ClassScore {
                class_id: class,
                score: 0.5,
                value: 1.0,
            }])
            .unwrap(),
            logits: None,
        }
    }

    use crate::domain::{ClassScore, Normalize, Ranked};

    const N: RowFormat = RowFormat::Image(Normalize {
        mean: [0.5; 3],
        std: [0.5; 3],
    });
    const TOP1: OutputRequest = OutputRequest {
        top_k: std::num::NonZeroUsize::MIN,
        logits: false,
    };

    fn row(bytes: &'static [u8]) -> Row {
        Row::Bytes(bytes::Bytes::from_static(bytes))
    }

    #[test]
    fn the_key_depends_on_every_input() {
        let k = ResponseCache::key("m", 1, 0, &N, TOP1, &row(b"row"));
        assert_eq!(k, ResponseCache::key("m", 1, 0, &N, TOP1, &row(b"row")));
        assert_ne!(k, ResponseCache::key("n", 1, 0, &N, TOP1, &row(b"row")));
        assert_ne!(k, ResponseCache::key("m", 2, 0, &N, TOP1, &row(b"row")));
        assert_ne!(k, ResponseCache::key("m", 1, 0, &N, TOP1, &row(b"rox")));
        assert_ne!(k, ResponseCache::key("m", 1, 1, &N, TOP1, &row(b"row")));
        let other = RowFormat::Image(Normalize {
            mean: [0.4; 3],
            std: [0.5; 3],
        });
        assert_ne!(k, ResponseCache::key("m", 1, 0, &other, TOP1, &row(b"row")));
        let tensor = RowFormat::TensorF32;
        assert_ne!(
            k,
            ResponseCache::key("m", 1, 0, &tensor, TOP1, &row(b"row"))
        );
        let top5 = OutputRequest::classes(5);
        assert_ne!(k, ResponseCache::key("m", 1, 0, &N, top5, &row(b"row")));
    }

    #[test]
    fn least_recently_used_entries_leave_first_and_bytes_stay_bounded() {
        let one = ResponseCache::entry_bytes(&out(0));
        let cache = ResponseCache::new(one * 2);
        cache.insert(1, out(1));
        cache.insert(2, out(2));
        assert_eq!(cache.get(1), Some(out(1))); // 1 is now the most recent
        cache.insert(3, out(3));
        assert_eq!(cache.get(2), None, "2 was the least recently used");
        assert_eq!(cache.get(1), Some(out(1)));
        assert_eq!(cache.get(3), Some(out(3)));
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.bytes(), one * 2);
        cache.insert(3, out(3));
        assert_eq!(
            cache.bytes(),
            one * 2,
            "replacing an entry does not grow the cache"
        );
    }

    #[test]
    fn an_entry_larger_than_the_cache_is_not_stored() {
        let cache = ResponseCache::new(8);
        cache.insert(1, out(1));
        assert!(cache.is_empty());
    }
}
