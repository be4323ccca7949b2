//! The JPEG decoding stage of libtorch's GPU instances (`--gpu-decode`): nvJPEG on the
//! instance's stream decodes a batch's JPEG rows at full size, in groups whose decoded
//! images fit the memory it is given; libtorch resizes, rounds and orients each there as
//! the CPU path does (`device_row`), into the group's buffer, which comes back into the
//! batch's host rows in one copy, so the engine takes them as any other row. What nvJPEG refuses or
//! fails, or cannot be resized on the GPU, is left to the CPU.
use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Kind, Tensor};

use super::cuda;
use crate::domain::ResizeFilter;
use crate::nvidia::nvjpeg;
use crate::preprocess::{BatchDecoder, DeviceDecode, JpegRow};

/// A GPU instance's JPEG decoder: nvJPEG on its stream, the device memory its decoded
/// images may hold at once, and events around its work (its device time).
pub struct GpuJpeg {
    decoder: nvjpeg::Decoder,
    index: usize,
    memory: u64,
    events: [cuda::Event; 2],
    /// Its stream could not be waited for after a failure: it decodes nothing more.
    broken: bool,
}

impl GpuJpeg {
    /// A decoder on GPU `index`'s current stream (the instance's: start it on the
    /// instance's thread, after its engine), its decoded images holding at most `memory`
    /// bytes of device memory at once; `None` where it cannot start (said once per
    /// instance): that instance's JPEG rows are then decoded on the CPU.
    pub fn start(nvjpeg: &'static nvjpeg::Library, index: usize, memory: u64) -> Option<GpuJpeg> {
        // nvJPEG works on the thread's current device: this instance's.
        let started = cuda::set_device(index)
            .and_then(|()| cuda::current_stream(index))
            .and_then(|stream| nvjpeg::Decoder::new(nvjpeg, stream))
            .and_then(|decoder| {
                let events = [cuda::Event::new()?, cuda::Event::new()?];
                Ok(GpuJpeg {
                    decoder,
                    index,
                    memory,
                    events,
                    broken: false,
                })
            });
        match started {
            Ok(jpeg) => {
                tracing::info!(
                    gpu = index,
                    decoder = jpeg.decoder.backend().label(),
                    nvjpeg = nvjpeg.version(),
                    "JPEG decode on the GPU"
                );
                Some(jpeg)
            }
            Err(e) => {
                tracing::warn!(
                    gpu = index,
                    "nvJPEG cannot decode here, JPEGs are decoded on the CPU: {e}"
                );
                None
            }
        }
    }

    /// Decodes what it can of `jpegs` into their rows of `rows`, marking each in `done`;
    /// the time from its first work on the stream to its last row's copy back.
    fn place(
        &mut self,
        jpegs: &[(usize, Arc<JpegRow>)],
        rows: &mut [u8],
        (height, width): (usize, usize),
        done: &mut [bool],
    ) -> Result<Duration, tch::TchError> {
        let torch = tch::TchError::Torch;
        let (index, device) = (self.index, Device::Cuda(self.index));
        let row = height * width * 3;
        let (height, width) = (height as i64, width as i64);
        self.events[0].record(index).map_err(torch)?;
        // Each image's planes (3 bytes a pixel) and its row in the group's buffer, held
        // until the group is copied back, and its float copy while it is resized (12 bytes
        // a pixel, one image at a time).
        let planes = |(w, h): (u32, u32)| 3 * u64::from(w) * u64::from(h);
        let mut next = 0;
        while next < jpegs.len() {
            // The next group: as many images as fit the memory; the others are left.
            let mut group = Vec::new();
            let (mut held, mut largest) = (0, 0);
            while let Some((_, jpeg)) = jpegs.get(next) {
                let (w, h) = (jpeg.width, jpeg.height);
                let need = planes((w, h));
                if need * 5 + row as u64 > self.memory || !resizable((w, h), (height, width)) {
                    // Left to the CPU.
                } else if held + need + row as u64 + 4 * largest.max(need) > self.memory {
                    break;
                } else {
                    match Tensor::f_empty([3, i64::from(h), i64::from(w)], (Kind::Uint8, device)) {
                        Ok(out) => {
                            group.push((next, out));
                            held += need + row as u64;
                            largest = largest.max(need);
                        }
                        Err(e) => {
                            tracing::debug!(
                                "no device memory for a decoded image ({e}); the CPU decodes it"
                            );
                        }
                    }
                }
                next += 1;
            }
            if group.is_empty() {
                continue;
            }
            let jobs: Vec<nvjpeg::Job<'_>> = group
                .iter()
                .map(|(i, out)| {
                    let jpeg = &jpegs[*i].1;
                    nvjpeg::Job {
                        bytes: &jpeg.bytes,
                        out: out.data_ptr() as *mut u8,
                        width: jpeg.width,
                        height: jpeg.height,
                    }
                })
                .collect();
            let events = &mut self.events;
            let mut settle = || {
                events[1].record(index)?;
                events[1].synchronize()
            };
            let results = self.decoder.decode(&jobs, &mut settle);
            // Each row made into the group's buffer, in order; then one copy to the host.
            let buffer = Tensor::f_empty(
                [group.len() as i64, height, width, 3],
                (Kind::Uint8, device),
            )?;
            let mut made = Vec::new();
            for ((i, out), result) in group.iter().zip(results) {
                let jpeg = &jpegs[*i].1;
                let resized = result.map_err(torch).and_then(|()| {
                    let resized =
                        device_row(out, jpeg.orientation, jpeg.settings.filter, height, width)?;
                    buffer.f_get(made.len() as i64)?.f_copy_(&resized)
                });
                match resized {
                    Ok(_) => made.push(*i),
                    Err(e) => {
                        tracing::debug!(
                            "an image was not decoded or resized on the GPU ({e}); the CPU does it"
                        );
                    }
                }
            }
            if made.is_empty() {
                continue;
            }
            // The copy to the host waits for the stream: the decoder's work is done.
            let host = buffer
                .f_narrow(0, 0, made.len() as i64)?
                .f_to_device(Device::Cpu)?
                .f_flatten(0, -1)?;
            let host = Vec::<u8>::try_from(&host)?;
            self.decoder.settled();
            for (i, made) in made.iter().zip(host.chunks_exact(row)) {
                let place = jpegs[*i].0;
                rows[place * row..(place + 1) * row].copy_from_slice(made);
                done[*i] = true;
            }
        }
        self.events[1].record(index).map_err(torch)?;
        self.events[1].synchronize().map_err(torch)?;
        self.decoder.settled();
        self.events[0].elapsed(&self.events[1]).map_err(torch)
    }

    /// After a failed `place`: the stream may still hold its work, which reads the batch's
    /// JPEGs and the decoder's state. Once the stream is done, the next batch decodes here
    /// again (the rows it left go to the CPU); if it cannot be waited for (the context is
    /// broken), this decoder leaves every JPEG to the CPU from then on.
    fn failed(&mut self, e: tch::TchError) {
        let waited = self.events[1]
            .record(self.index)
            .and_then(|()| self.events[1].synchronize());
        match waited {
            Ok(()) => {
                self.decoder.settled();
                tracing::warn!(
                    gpu = self.index,
                    "JPEG decode on the GPU failed ({e}); the CPU decodes what it left"
                );
            }
            Err(wait) => {
                self.broken = true;
                tracing::error!(gpu = self.index, "JPEG decode on the GPU failed ({e}) and its stream cannot be waited for ({wait}): this instance decodes JPEGs on the CPU from now on");
            }
        }
    }
}

impl BatchDecoder for GpuJpeg {
    fn decode(
        &mut self,
        jpegs: &[(usize, Arc<JpegRow>)],
        rows: &mut [u8],
        height: usize,
        width: usize,
    ) -> DeviceDecode {
        let mut done = vec![false; jpegs.len()];
        let took = if self.broken {
            Duration::ZERO
        } else {
            self.place(jpegs, rows, (height, width), &mut done)
                .unwrap_or_else(|e| {
                    self.failed(e);
                    Duration::ZERO
                })
        };
        DeviceDecode {
            path: self.decoder.backend().label(),
            decoded: done.iter().filter(|d| **d).count(),
            took,
            left: done
                .iter()
                .enumerate()
                .filter_map(|(i, done)| (!done).then_some(i))
                .collect(),
        }
    }
}

/// Whether a `w` x `h` image resizes to `height` x `width` on a GPU: libtorch's CUDA
/// antialiased resize refuses shrinking by much more than 64 a side (its filter's taps no
/// longer fit a block's shared memory); such images are decoded and resized on the CPU.
fn resizable((w, h): (u32, u32), (height, width): (i64, i64)) -> bool {
    const MAX_SHRINK: i64 = 64;
    i64::from(w.max(h)) <= MAX_SHRINK * height.min(width)
}

/// A decoded JPEG (`img`: `[3, h, w]` u8 planes, as stored, on any device) as the model's
/// row, `[height, width, 3]` u8 there, made as the CPU path makes it: resized with the
/// preprocessor's filter (antialiased bilinear, or plain bilinear for `linear`) to the
/// model's size with the sides swapped where the EXIF orientation turns the image, rounded
/// to u8, then oriented.
fn device_row(
    img: &Tensor,
    orientation: u16,
    filter: ResizeFilter,
    height: i64,
    width: i64,
) -> Result<Tensor, tch::TchError> {
    let (th, tw) = if matches!(orientation, 5..=8) {
        (width, height)
    } else {
        (height, width)
    };
    let x = img.f_unsqueeze(0)?.f_to_kind(Kind::Float)?;
    let x = match filter {
        ResizeFilter::Linear => x.f_upsample_bilinear2d([th, tw], false, None, None)?,
        // `area` JPEGs stay on the CPU path (`preprocess::prepare`).
        ResizeFilter::Bilinear | ResizeFilter::Area => {
            x.f_internal_upsample_bilinear2d_aa([th, tw], false, None, None)?
        }
    };
    let x = x
        .f_round()?
        .f_clamp(0, 255)?
        .f_to_kind(Kind::Uint8)?
        .f_squeeze_dim(0)?;
    let x = match orientation {
        2 => x.f_flip([2])?,
        3 => x.f_flip([1, 2])?,
        4 => x.f_flip([1])?,
        5 => x.f_transpose(1, 2)?,
        6 => x.f_transpose(1, 2)?.f_flip([2])?,
        7 => x.f_transpose(1, 2)?.f_flip([1, 2])?,
        8 => x.f_transpose(1, 2)?.f_flip([1])?,
        _ => x,
    };
    x.f_permute([1, 2, 0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::{self, DecodeBudget, PreprocessSettings, Row};

    /// `rgb` (`h` x `w` HWC u8) as the planes nvJPEG writes: `[3, h, w]`.
    fn planes(rgb: &[u8], h: usize, w: usize) -> Tensor {
        Tensor::from_slice(rgb)
            .view([h as i64, w as i64, 3])
            .permute([2, 0, 1])
            .contiguous()
    }

    #[test]
    fn device_rows_are_oriented_as_the_cpu_path_orients() {
        // 5x7, every pixel its own; no resampling (the target is the oriented size).
        let (h, w) = (5usize, 7usize);
        let rgb: Vec<u8> = (0..h * w * 3).map(|i| (i * 7 % 251) as u8).collect();
        for orientation in 1..=8u16 {
            let (rh, rw) = if orientation >= 5 { (w, h) } else { (h, w) };
            let row = device_row(
                &planes(&rgb, h, w),
                orientation,
                ResizeFilter::Bilinear,
                rh as i64,
                rw as i64,
            )
            .unwrap()
            .contiguous();
            let got = Vec::<u8>::try_from(&row.flatten(0, -1)).unwrap();
            let mut want = vec![0; rgb.len()];
            preprocess::exif::apply_orientation(&rgb, w, h, orientation, &mut want);
            assert_eq!(got, want, "orientation {orientation}");
        }
    }

    #[test]
    fn device_rows_of_the_test_photos_are_the_cpu_paths_within_one_level() {
        // Each photo as a GPU-decoded JPEG row would be made: decoded at full size (here by
        // libjpeg-turbo, there by nvJPEG), resized and oriented by libtorch (here on the
        // CPU, there on CUDA), against the CPU path's row. The photos the CPU path decodes
        // at a DCT scale stay on the CPU path.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/photos");
        let (budget, metrics) = (
            std::sync::Arc::new(DecodeBudget::unlimited()),
            std::sync::Arc::new(crate::telemetry::Metrics::new()),
        );
        for filter in [ResizeFilter::Bilinear, ResizeFilter::Linear] {
            let settings = std::sync::Arc::new(PreprocessSettings {
                width: 224,
                height: 224,
                dct_scaling_min_side: 448,
                max_pixels: 1 << 28,
                filter,
            });
            let (mut worst, mut total, mut values, mut on_gpu) = (0u8, 0u64, 0u64, 0);
            for size in ["small", "medium", "large"] {
                for entry in std::fs::read_dir(dir.join(size)).unwrap() {
                    let bytes = std::fs::read(entry.unwrap().path()).unwrap();
                    let row = preprocess::prepare(
                        bytes.clone().into(),
                        &settings,
                        true,
                        &budget,
                        &metrics,
                    );
                    let header = turbojpeg::read_header(&bytes).unwrap();
                    let scaled = preprocess::dct_scale(
                        header.width,
                        header.height,
                        settings.dct_scaling_min_side,
                    ) != turbojpeg::ScalingFactor::ONE;
                    let jpeg = match row {
                        Ok(Row::Jpeg(jpeg)) if !scaled => jpeg,
                        Ok(Row::Bytes(_)) if scaled => continue,
                        _ => panic!("a baseline photo goes to the GPU decoder unless the CPU path scales it: {row:?}"),
                    };
                    on_gpu += 1;
                    let mut d = turbojpeg::Decompressor::new().unwrap();
                    let (w, h) = (jpeg.width as usize, jpeg.height as usize);
                    let mut rgb = vec![0u8; w * h * 3];
                    let image = turbojpeg::Image {
                        pixels: rgb.as_mut_slice(),
                        width: w,
                        pitch: w * 3,
                        height: h,
                        format: turbojpeg::PixelFormat::RGB,
                    };
                    d.decompress(&bytes, image).unwrap();
                    let device =
                        device_row(&planes(&rgb, h, w), jpeg.orientation, filter, 224, 224)
                            .unwrap();
                    let device = Vec::<u8>::try_from(&device.contiguous().flatten(0, -1)).unwrap();
                    let mut cpu = vec![0u8; settings.row_len()];
                    preprocess::decode_into(&bytes, &settings, &budget, &mut cpu).unwrap();
                    for (a, b) in device.iter().zip(&cpu) {
                        let d = a.abs_diff(*b);
                        worst = worst.max(d);
                        total += u64::from(d);
                        values += 1;
                    }
                }
            }
            assert!(on_gpu >= 20, "{on_gpu} photos went to the GPU decoder");
            let mean = total as f64 / values as f64;
            eprintln!(
                "{filter:?}: largest difference {worst}, mean {mean:.4} over {values} values"
            );
            assert!(
                worst <= 1 && mean < 0.2,
                "{filter:?}: largest {worst}, mean {mean}"
            );
        }
    }
}
