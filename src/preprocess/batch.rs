//! A batch's JPEG rows decoded together on the instance's device, a stage of its own
//! before the engine runs the batch (nvJPEG on a GPU instance: `engine/libtorch/jpeg.rs`),
//! so that engines take tensor rows only. The decoder writes each image it decodes into
//! its row of the batch, as the CPU path would have made it, and leaves the rest to the
//! CPU; `decode_rows` is the stage as an instance runs it.
use std::sync::Arc;
use std::time::Duration;

use super::{CpuReason, JpegRow, PreprocessError};

/// A decoder of a batch's JPEG rows on an instance's device.
pub trait BatchDecoder: Send {
    /// Decodes what it can of `jpegs` (each with its row's place in `rows`: the batch's
    /// u8 HWC rows of `height` x `width`) into its row; every one it does not decode is
    /// in the answer's `left`.
    fn decode(
        &mut self,
        jpegs: &[(usize, Arc<JpegRow>)],
        rows: &mut [u8],
        height: usize,
        width: usize,
    ) -> DeviceDecode;
}

/// What a decoder did with a batch's JPEGs.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceDecode {
    /// The `path` label of `visiongate_decode_images_total`: `gpu_hardware` or
    /// `gpu_assisted`.
    pub path: &'static str,
    /// How many it decoded, and the time from its first work on the device to the last
    /// row copied into the batch.
    pub decoded: usize,
    pub took: Duration,
    /// The indices into `jpegs` of those it refused or failed: the CPU decodes them.
    pub left: Vec<usize>,
}

/// Decodes a batch's JPEG rows (`jpegs`, each with its place in `rows`, rows of `row`
/// bytes): on the instance's device where it has a decoder, on the CPU what that decoder
/// leaves or where it has none; each counted on its path. Returns the rows neither could
/// decode, by place.
pub fn decode_rows(
    decoder: Option<&mut (dyn BatchDecoder + '_)>,
    jpegs: &[(usize, Arc<JpegRow>)],
    rows: &mut [u8],
    height: usize,
    width: usize,
) -> Vec<(usize, PreprocessError)> {
    if jpegs.is_empty() {
        return Vec::new();
    }
    let row = height * width * 3;
    let (left, reason) = match decoder {
        Some(decoder) => {
            let done = decoder.decode(jpegs, rows, height, width);
            if done.decoded > 0 {
                jpegs[0].1.metrics.count_decode(
                    done.path,
                    "gpu_decodable",
                    done.decoded as u64,
                    done.took,
                );
            }
            (done.left, CpuReason::GpuFailed)
        }
        None => ((0..jpegs.len()).collect(), CpuReason::NoGpuDecoder),
    };
    let mut unusable = Vec::new();
    for (place, jpeg) in left.into_iter().map(|i| &jpegs[i]) {
        let out = &mut rows[place * row..(place + 1) * row];
        if let Err(e) = jpeg.decode_on_cpu(reason, out) {
            unusable.push((*place, e));
        }
    }
    unusable
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::{DecodeBudget, PreprocessSettings};
    use crate::telemetry::Metrics;

    /// Writes `fill` into the rows of the JPEGs at even indices, leaves the others.
    struct Evens {
        fill: u8,
    }

    impl BatchDecoder for Evens {
        fn decode(
            &mut self,
            jpegs: &[(usize, Arc<JpegRow>)],
            rows: &mut [u8],
            height: usize,
            width: usize,
        ) -> DeviceDecode {
            let row = height * width * 3;
            let mut decoded = 0;
            let mut left = Vec::new();
            for (i, (place, _)) in jpegs.iter().enumerate() {
                if i % 2 == 0 {
                    rows[place * row..(place + 1) * row].fill(self.fill);
                    decoded += 1;
                } else {
                    left.push(i);
                }
            }
            DeviceDecode {
                path: "gpu_hardware",
                decoded,
                took: Duration::from_millis(3),
                left,
            }
        }
    }

    fn decoded(metrics: &Metrics, path: &str, reason: &str) -> f64 {
        let text = metrics.render();
        let labels = format!("path=\"{path}\",reason=\"{reason}\"");
        text.lines()
            .find(|l| l.starts_with("visiongate_decode_images_total") && l.contains(&labels))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }

    #[test]
    fn the_device_decodes_what_it_takes_and_the_cpu_the_rest_each_counted_on_its_path() {
        let settings = Arc::new(PreprocessSettings {
            width: 8,
            height: 8,
            dct_scaling_min_side: 0,
            max_pixels: 1 << 20,
            filter: Default::default(),
        });
        let metrics = Arc::new(Metrics::new());
        let budget = Arc::new(DecodeBudget::new(1 << 26, None));
        let jpeg = |bytes: Vec<u8>| {
            Arc::new(JpegRow {
                bytes: bytes.into(),
                width: 16,
                height: 16,
                orientation: 1,
                settings: settings.clone(),
                budget: budget.clone(),
                metrics: metrics.clone(),
            })
        };
        let mut encoded = Vec::new();
        image::DynamicImage::ImageRgb8(image::RgbImage::from_pixel(
            16,
            16,
            image::Rgb([200, 40, 40]),
        ))
        .write_to(
            &mut std::io::Cursor::new(&mut encoded),
            image::ImageFormat::Jpeg,
        )
        .unwrap();
        let good = jpeg(encoded.clone());
        // Its start alone: no decoder can decode it.
        let broken = jpeg(encoded[..20].to_vec());
        // Rows 0 and 2 the device's (row 2's broken JPEG never reaches the CPU), rows 1 and
        // 3 the CPU's, and row 3's JPEG cannot be decoded there.
        let jpegs = vec![
            (0, good.clone()),
            (1, good.clone()),
            (2, broken.clone()),
            (3, broken),
        ];
        let row = 8 * 8 * 3;
        let mut rows = vec![0u8; 4 * row];
        let unusable = decode_rows(Some(&mut Evens { fill: 7 }), &jpegs, &mut rows, 8, 8);
        assert_eq!(unusable.iter().map(|u| u.0).collect::<Vec<_>>(), [3]);
        assert!(rows[..row].iter().all(|&v| v == 7));
        assert!(rows[2 * row..3 * row].iter().all(|&v| v == 7));
        let reddish = |p: &[u8]| p[0] > 150 && p[1] < 90 && p[2] < 90;
        assert!(
            rows[row..2 * row].chunks(3).all(reddish),
            "{:?}",
            &rows[row..2 * row]
        );
        assert_eq!(decoded(&metrics, "gpu_hardware", "gpu_decodable"), 2.0);
        assert_eq!(decoded(&metrics, "cpu", "gpu_failed"), 2.0);

        // Without a decoder, every JPEG on the CPU.
        let mut rows = vec![0u8; 2 * row];
        let unusable = decode_rows(None, &jpegs[..2], &mut rows, 8, 8);
        assert!(unusable.is_empty());
        assert!(rows.chunks(3).all(reddish));
        assert_eq!(decoded(&metrics, "cpu", "no_gpu_decoder"), 2.0);
    }
}
