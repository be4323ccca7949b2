//! Image bytes → one u8 HWC RGB row of the model's input size. Pure: no tch, no actix.
//!
//! JPEG goes through libjpeg-turbo with DCT-domain scaling; PNG, WebP, BMP and GIF (first
//! frame) through the `image` crate. EXIF orientation is applied, grey/CMYK become RGB,
//! alpha is dropped. Dimensions are read from the header and checked against the pixel
//! limit before any pixel buffer is allocated; the memory the decode will hold is then
//! reserved from the decode budget shared by all decode threads (`budget.rs`).
//! Normalization to f32 happens on the device.

mod batch;
mod budget;
pub(crate) mod exif;
mod flags;
pub mod jpeg;
mod pool;

use std::io::Cursor;
use std::sync::Arc;

use bytes::Bytes;

use fast_image_resize::{
    self as fr, images::Image as FrImage, PixelType, ResizeAlg, ResizeOptions,
};
use image::{ImageDecoder, ImageFormat};
use turbojpeg::{Colorspace, Decompressor, PixelFormat, ScalingFactor};

use crate::domain::ResizeFilter;
use crate::error::{ErrorKind, HasKind};
use crate::telemetry::Metrics;

pub use batch::{decode_rows, BatchDecoder, DeviceDecode};
pub use budget::DecodeBudget;
pub use flags::{decode_threads, DecodeFlags};
pub use jpeg::CpuReason;
pub use pool::{Decoded, PreprocessPool};

use budget::Reserved;

/// What the preprocessor produces and what it accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessSettings {
    pub width: u32,
    pub height: u32,
    /// JPEG: largest DCT down-scaling (1/2, 1/4, 1/8) that keeps the short side at or
    /// above this; 0 disables it.
    pub dct_scaling_min_side: u32,
    /// Largest accepted image, in pixels (width × height from the header).
    pub max_pixels: u64,
    /// How the image is resampled to `width` x `height`.
    pub filter: ResizeFilter,
}

impl PreprocessSettings {
    pub fn row_len(&self) -> usize {
        self.width as usize * self.height as usize * 3
    }
}

/// Why one file could not be used. Each maps to a per-file error code in `/predict`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PreprocessError {
    #[error("the file is empty")]
    Empty,
    #[error("not a supported image: {0}")]
    Unsupported(String),
    #[error("cannot decode the image: {0}")]
    Invalid(String),
    #[error("image is {width}x{height} = {pixels} pixels, above the limit of {limit}")]
    TooLarge {
        width: u64,
        height: u64,
        pixels: u64,
        limit: u64,
    },
    #[error("the file is {size} bytes, above the limit of {limit}")]
    FileTooLarge { size: u64, limit: u64 },
    #[error(
        "decoding this {width}x{height} image takes about {bytes} bytes of memory, above the \
         decode memory budget of {budget} bytes"
    )]
    OverBudget {
        width: u64,
        height: u64,
        bytes: u64,
        budget: u64,
    },
}

impl HasKind for PreprocessError {
    fn kind(&self) -> ErrorKind {
        match self {
            PreprocessError::Empty | PreprocessError::Invalid(_) => ErrorKind::InvalidInput,
            PreprocessError::Unsupported(_) => ErrorKind::UnsupportedMediaType,
            PreprocessError::TooLarge { .. }
            | PreprocessError::FileTooLarge { .. }
            | PreprocessError::OverBudget { .. } => ErrorKind::PayloadTooLarge,
        }
    }
}

impl PreprocessError {
    /// The per-file error code of `/predict`.
    pub fn code(&self) -> &'static str {
        match self {
            PreprocessError::Empty => "empty_file",
            PreprocessError::Unsupported(_) => "unsupported_format",
            PreprocessError::Invalid(_) => "invalid_image",
            PreprocessError::TooLarge { .. } | PreprocessError::OverBudget { .. } => {
                "image_too_large"
            }
            PreprocessError::FileTooLarge { .. } => "file_too_large",
        }
    }
}

/// One row of a model's input.
#[derive(Debug, Clone)]
pub enum Row {
    /// A preprocessed image (u8 HWC RGB of the model's input size), or a caller's tensor
    /// row (its little-endian bytes, a slice of the request).
    Bytes(Bytes),
    /// A JPEG the classifier's instance decodes on its GPU, its structure checked here.
    Jpeg(Arc<JpegRow>),
}

/// A JPEG for the GPU decoder, with what its header says and how to decode it on the CPU
/// instead (what an instance does when the GPU decoder fails it at decode time, or when it
/// has none).
pub struct JpegRow {
    pub bytes: Bytes,
    /// As stored (before the EXIF orientation).
    pub width: u32,
    pub height: u32,
    /// EXIF orientation, 1..=8.
    pub orientation: u16,
    pub settings: Arc<PreprocessSettings>,
    budget: Arc<DecodeBudget>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for JpegRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JpegRow")
            .field("bytes", &self.bytes.len())
            .field("width", &self.width)
            .field("height", &self.height)
            .field("orientation", &self.orientation)
            .finish_non_exhaustive()
    }
}

impl JpegRow {
    /// Decodes it on the CPU into `out` (the model's row), counted with `reason`.
    pub fn decode_on_cpu(&self, reason: CpuReason, out: &mut [u8]) -> Result<(), PreprocessError> {
        decode_counted(
            &self.bytes,
            &self.settings,
            &self.budget,
            &self.metrics,
            reason,
            out,
        )
    }
}

/// One image as the classifier takes it: a JPEG whose structure the GPU decoder takes,
/// whole (`gpu`: the classifier's instances decode on a GPU), otherwise decoded here.
pub fn prepare(
    bytes: Bytes,
    settings: &Arc<PreprocessSettings>,
    gpu: bool,
    budget: &Arc<DecodeBudget>,
    metrics: &Arc<Metrics>,
) -> Result<Row, PreprocessError> {
    let reason = if !gpu {
        CpuReason::NoGpuDecoder
    } else if settings.filter == ResizeFilter::Area {
        CpuReason::ResizeFilter
    } else if !bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        CpuReason::NotJpeg
    } else {
        let structure = jpeg::walk(&bytes, MAX_JPEG_SCANS as usize);
        match (jpeg::gpu_fallback(&structure), structure.frame) {
            (None, Some(frame)) => {
                let (width, height) = (u32::from(frame.width), u32::from(frame.height));
                check_pixels(u64::from(width), u64::from(height), settings)?;
                let scale = dct_scale(
                    width as usize,
                    height as usize,
                    settings.dct_scaling_min_side,
                );
                if scale != ScalingFactor::ONE {
                    CpuReason::DctScale
                } else {
                    return Ok(Row::Jpeg(Arc::new(JpegRow {
                        orientation: exif::orientation(&bytes),
                        bytes,
                        width,
                        height,
                        settings: settings.clone(),
                        budget: budget.clone(),
                        metrics: metrics.clone(),
                    })));
                }
            }
            (Some(reason), _) => reason,
            (None, None) => CpuReason::Damaged,
        }
    };
    let mut row = vec![0u8; settings.row_len()];
    decode_counted(&bytes, settings, budget, metrics, reason, &mut row)?;
    Ok(Row::Bytes(Bytes::from(row)))
}

/// `decode_into`, counted in the decode metrics as a CPU decode for `reason`; a panic in a
/// decoder is this file's error.
fn decode_counted(
    bytes: &[u8],
    settings: &PreprocessSettings,
    budget: &DecodeBudget,
    metrics: &Metrics,
    reason: CpuReason,
    out: &mut [u8],
) -> Result<(), PreprocessError> {
    let started = std::time::Instant::now();
    crate::memory::note_activity();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        decode_into(bytes, settings, budget, out)
    }))
    .unwrap_or_else(|_| {
        Err(PreprocessError::Invalid(
            "the decoder failed on this file".into(),
        ))
    });
    metrics.count_cpu_decode(reason.label(), started.elapsed());
    result
}

/// Decodes `bytes` and writes the resized RGB image into `out` (`row_len()` bytes, HWC),
/// holding the memory it takes reserved from `budget` meanwhile.
pub fn decode_into(
    bytes: &[u8],
    settings: &PreprocessSettings,
    budget: &DecodeBudget,
    out: &mut [u8],
) -> Result<(), PreprocessError> {
    assert_eq!(
        out.len(),
        settings.row_len(),
        "output row has the model's size"
    );
    if bytes.is_empty() {
        return Err(PreprocessError::Empty);
    }
    let format = image::guess_format(bytes).map_err(|_| {
        PreprocessError::Invalid("the content is not a recognised image format".into())
    })?;
    let decoded = match format {
        ImageFormat::Jpeg => decode_jpeg(bytes, settings, budget)?,
        ImageFormat::Png | ImageFormat::WebP | ImageFormat::Bmp | ImageFormat::Gif => {
            decode_with_image(bytes, format, settings, budget)?
        }
        other => {
            return Err(PreprocessError::Unsupported(format!(
                "{other:?} images are not accepted; send JPEG, PNG, WebP, BMP or GIF"
            )))
        }
    };
    let orientation = exif::orientation(bytes);
    resize_oriented(decoded, orientation, settings, out)
}

/// A decoded RGB8 image, tightly packed, with the memory reserved for it and its resize.
struct Rgb<'a> {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
    _reserved: Reserved<'a>,
}

/// What resizing a `width`x`height` image holds besides it: the convolution's
/// intermediate image, one pass done (at most the long side of the source by that of the
/// output, both ways).
fn resize_bytes(width: u64, height: u64, settings: &PreprocessSettings) -> u64 {
    (width + height) * u64::from(settings.width.max(settings.height)) * 3
}

fn check_pixels(
    width: u64,
    height: u64,
    settings: &PreprocessSettings,
) -> Result<(), PreprocessError> {
    let pixels = width * height;
    if width == 0 || height == 0 {
        return Err(PreprocessError::Invalid("the image has no pixels".into()));
    }
    if pixels > settings.max_pixels {
        return Err(PreprocessError::TooLarge {
            width,
            height,
            pixels,
            limit: settings.max_pixels,
        });
    }
    Ok(())
}

/// The DCT scaling factor for a `width`x`height` JPEG: the smallest scale whose short side
/// stays at or above `min_side`.
pub fn dct_scale(width: usize, height: usize, min_side: u32) -> ScalingFactor {
    if min_side == 0 {
        return ScalingFactor::ONE;
    }
    for f in [
        ScalingFactor::ONE_EIGHTH,
        ScalingFactor::ONE_QUARTER,
        ScalingFactor::ONE_HALF,
    ] {
        if f.scale(width).min(f.scale(height)) >= min_side as usize {
            return f;
        }
    }
    ScalingFactor::ONE
}

/// The most scans a progressive JPEG may have. Encoders write about 10 (libjpeg's default
/// script), at most a few dozen; each scan is one more pass over the whole image, so a
/// small file with hundreds of repeated scans costs seconds of CPU.
const MAX_JPEG_SCANS: u32 = 100;

fn decode_jpeg<'a>(
    bytes: &[u8],
    settings: &PreprocessSettings,
    budget: &'a DecodeBudget,
) -> Result<Rgb<'a>, PreprocessError> {
    let invalid = |e: turbojpeg::Error| PreprocessError::Invalid(format!("JPEG: {e}"));
    // Scans counted before any decoding, so a scan bomb costs one pass over its bytes;
    // libjpeg-turbo's own limit stays as the exact guard.
    let scans = jpeg::walk(bytes, MAX_JPEG_SCANS as usize).scans;
    if scans > MAX_JPEG_SCANS as usize {
        return Err(PreprocessError::Invalid(format!(
            "JPEG: more than {MAX_JPEG_SCANS} scans (a progressive image has about 10)"
        )));
    }
    let mut d = Decompressor::new().map_err(invalid)?;
    d.set_scan_limit(MAX_JPEG_SCANS).map_err(invalid)?;
    let header = d.read_header(bytes).map_err(invalid)?;
    check_pixels(header.width as u64, header.height as u64, settings)?;
    let scale = dct_scale(header.width, header.height, settings.dct_scaling_min_side);
    d.set_scaling_factor(scale).map_err(invalid)?;
    let scaled = header.scaled(scale);
    let (w, h) = (scaled.width, scaled.height);
    let cmyk = matches!(header.colorspace, Colorspace::CMYK | Colorspace::YCCK);
    let (format, channels) = if cmyk {
        (PixelFormat::CMYK, 4)
    } else {
        (PixelFormat::RGB, 3)
    };
    // The output (and its RGB copy for CMYK); with more than one scan, libjpeg also holds
    // every DCT coefficient of the full-size image (2 bytes a sample, each component at
    // most full size).
    let (full, scaled_px) = (header.width as u64 * header.height as u64, (w * h) as u64);
    let mut need = scaled_px * channels as u64 + if cmyk { scaled_px * 3 } else { 0 };
    if scans > 1 {
        let components = match header.colorspace {
            Colorspace::Gray => 1,
            Colorspace::CMYK | Colorspace::YCCK => 4,
            _ => 3,
        };
        need += full * 2 * components;
    }
    need += resize_bytes(w as u64, h as u64, settings);
    let reserved = budget.reserve(need, header.width as u64, header.height as u64)?;
    let mut pixels = vec![0u8; w * h * channels];
    d.decompress(
        bytes,
        turbojpeg::Image {
            pixels: pixels.as_mut_slice(),
            width: w,
            pitch: w * channels,
            height: h,
            format,
        },
    )
    .map_err(invalid)?;
    if cmyk {
        pixels = cmyk_to_rgb(&pixels);
    }
    Ok(Rgb {
        width: w as u32,
        height: h as u32,
        pixels,
        _reserved: reserved,
    })
}

/// CMYK JPEGs (Adobe, as Photoshop and Pillow write them) store inverted ink values, so
/// R = C·K/255 on the decoded samples. No colour management, like Pillow's `convert("RGB")`.
fn cmyk_to_rgb(cmyk: &[u8]) -> Vec<u8> {
    let mut rgb = Vec::with_capacity(cmyk.len() / 4 * 3);
    for px in cmyk.chunks_exact(4) {
        let k = px[3] as u32;
        for &c in &px[..3] {
            rgb.push(((c as u32 * k + 127) / 255) as u8);
        }
    }
    rgb
}

fn decode_with_image<'a>(
    bytes: &[u8],
    format: ImageFormat,
    settings: &PreprocessSettings,
    budget: &'a DecodeBudget,
) -> Result<Rgb<'a>, PreprocessError> {
    let invalid = |e: image::ImageError| PreprocessError::Invalid(format!("{format:?}: {e}"));
    let mut reader = image::ImageReader::with_format(Cursor::new(bytes), format);
    let mut limits = image::Limits::default();
    // The header is checked below; this also bounds what a lying header could make it
    // allocate.
    limits.max_alloc = Some(settings.max_pixels.saturating_mul(8).max(64 << 20));
    reader.limits(limits);
    let decoder = reader.into_decoder().map_err(invalid)?;
    let (w, h) = decoder.dimensions();
    let (w, h) = (u64::from(w), u64::from(h));
    check_pixels(w, h, settings)?;
    // The image in the decoder's colour type, then its RGB8 copy unless it is RGB8.
    let mut need = decoder.total_bytes();
    let rgb8 = decoder.color_type() == image::ColorType::Rgb8;
    if !rgb8 {
        need += w * h * 3;
    }
    if format == ImageFormat::WebP {
        need += webp_working_bytes(bytes, w * h, !rgb8);
    }
    need += resize_bytes(w, h, settings);
    let reserved = budget.reserve(need, w, h)?;
    let img = image::DynamicImage::from_decoder(decoder).map_err(invalid)?;
    let rgb = img.into_rgb8();
    Ok(Rgb {
        width: rgb.width(),
        height: rgb.height(),
        pixels: rgb.into_raw(),
        _reserved: reserved,
    })
}

/// What the WebP decoder holds besides its output, by what the file's chunks say it is:
/// a lossless image without alpha is decoded as RGBA (4 bytes a pixel) before its RGB copy;
/// a lossy one through Y, U and V planes (1.5) from two copies of its compressed data, its
/// alpha channel as a lossless RGBA image plus two planes (6); an animation's first frame
/// is composed on an RGBA canvas from an RGBA frame (8) decoded as above. The frames of an
/// animation are not opened: it is counted at its worst. Each kind is held to this by
/// `tests/decode_reserves_what_it_allocates.rs`.
fn webp_working_bytes(bytes: &[u8], pixels: u64, has_alpha: bool) -> u64 {
    let (mut animated, mut lossless, mut alpha) = (false, false, false);
    // The RIFF header (12 bytes), then chunks: a FourCC, a little-endian size, the data
    // padded to an even length.
    let mut at = 12usize;
    while let Some(head) = bytes.get(at..).and_then(|rest| rest.get(..8)) {
        match &head[..4] {
            b"ANIM" | b"ANMF" => animated = true,
            b"VP8L" => lossless = true,
            b"ALPH" => alpha = true,
            _ => {}
        }
        let size = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        at = at
            .saturating_add(8)
            .saturating_add(size)
            .saturating_add(size & 1);
    }
    let compressed = 2 * bytes.len() as u64;
    // Half bytes a pixel, so that 1.5 stays whole.
    let lossy = |alpha: bool| 3 + if alpha { 12 } else { 0 };
    if animated {
        pixels * (16 + lossy(true)) / 2 + compressed
    } else if lossless {
        if has_alpha {
            0
        } else {
            pixels * 4
        }
    } else {
        pixels * lossy(alpha) / 2 + compressed
    }
}

/// Resizes (by default antialiased bilinear, as Pillow/torchvision; `settings.filter`) and
/// applies the EXIF orientation.
/// Orientation is applied after resizing, on the small image: with a stretch resize the two
/// orders give the same pixels, and this one moves 50-1000x fewer of them.
fn resize_oriented(
    src: Rgb,
    orientation: u16,
    settings: &PreprocessSettings,
    out: &mut [u8],
) -> Result<(), PreprocessError> {
    let swaps_axes = matches!(orientation, 5..=8);
    let (tw, th) = if swaps_axes {
        (settings.height, settings.width)
    } else {
        (settings.width, settings.height)
    };
    let src_img = FrImage::from_vec_u8(src.width, src.height, src.pixels, PixelType::U8x3)
        .map_err(|e| PreprocessError::Invalid(format!("decoded buffer: {e}")))?;
    let alg = match settings.filter {
        ResizeFilter::Bilinear => ResizeAlg::Convolution(fr::FilterType::Bilinear),
        ResizeFilter::Area => ResizeAlg::Convolution(fr::FilterType::Box),
        ResizeFilter::Linear => ResizeAlg::Interpolation(fr::FilterType::Bilinear),
    };
    let options = ResizeOptions::new().resize_alg(alg);
    let mut resizer = fr::Resizer::new();
    if orientation <= 1 || orientation > 8 {
        let mut dst = FrImage::from_slice_u8(tw, th, out, PixelType::U8x3)
            .map_err(|e| PreprocessError::Invalid(format!("output buffer: {e}")))?;
        return resizer
            .resize(&src_img, &mut dst, &options)
            .map_err(|e| PreprocessError::Invalid(format!("resize: {e}")));
    }
    let mut tmp = FrImage::new(tw, th, PixelType::U8x3);
    resizer
        .resize(&src_img, &mut tmp, &options)
        .map_err(|e| PreprocessError::Invalid(format!("resize: {e}")))?;
    exif::apply_orientation(tmp.buffer(), tw as usize, th as usize, orientation, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> PreprocessSettings {
        PreprocessSettings {
            width: 224,
            height: 224,
            dct_scaling_min_side: 224,
            max_pixels: 100_000_000,
            filter: Default::default(),
        }
    }

    fn encode(img: image::DynamicImage, format: ImageFormat) -> Vec<u8> {
        let mut buf = Cursor::new(Vec::new());
        img.write_to(&mut buf, format).unwrap();
        buf.into_inner()
    }

    fn pixel(out: &[u8], x: usize, y: usize) -> [u8; 3] {
        let i = (y * 224 + x) * 3;
        [out[i], out[i + 1], out[i + 2]]
    }

    /// Left half red, right half blue, so orientation and channel order are visible.
    fn halves(w: u32, h: u32) -> image::RgbImage {
        image::RgbImage::from_fn(w, h, |x, _| {
            if x < w / 2 {
                image::Rgb([255, 0, 0])
            } else {
                image::Rgb([0, 0, 255])
            }
        })
    }

    #[test]
    fn webp_kind_is_read_from_its_chunks_whatever_their_sizes_say() {
        // A lossless chunk claiming 4 GiB: found, and the walk ends at the end of the data.
        let lossless = b"RIFF\0\0\0\0WEBPVP8L\xff\xff\xff\xff";
        assert_eq!(webp_working_bytes(lossless, 10, false), 40);
        assert_eq!(webp_working_bytes(lossless, 10, true), 0);
        // Lossy with alpha: planes (1.5) and alpha (6) a pixel, two copies of the file.
        let alpha =
            b"RIFF\0\0\0\0WEBPVP8X\x0a\0\0\0\0\0\0\0\0\0\0\0\0\0ALPH\x01\0\0\0\0\0VP8 \0\0\0\0";
        assert_eq!(
            webp_working_bytes(alpha, 10, true),
            75 + 2 * alpha.len() as u64
        );
        // Too short to hold a chunk: lossy, the least.
        assert_eq!(webp_working_bytes(b"RIFF", 10, false), 15 + 8);
    }

    #[test]
    fn dct_scale_keeps_the_short_side_above_the_threshold() {
        assert_eq!(dct_scale(4000, 3000, 224), ScalingFactor::ONE_EIGHTH); // 375
        assert_eq!(dct_scale(4000, 3000, 448), ScalingFactor::ONE_QUARTER); // 750
        assert_eq!(dct_scale(1920, 1200, 224), ScalingFactor::ONE_QUARTER); // 300
        assert_eq!(dct_scale(500, 375, 224), ScalingFactor::ONE); // 1/2 would be 188
        assert_eq!(dct_scale(4000, 3000, 0), ScalingFactor::ONE);
    }

    #[test]
    fn every_accepted_format_decodes_to_the_same_colours() {
        let img = image::DynamicImage::ImageRgb8(halves(300, 200));
        for format in [
            ImageFormat::Png,
            ImageFormat::Bmp,
            ImageFormat::Gif,
            ImageFormat::WebP,
            ImageFormat::Jpeg,
        ] {
            let bytes = encode(img.clone(), format);
            let mut out = vec![0; settings().row_len()];
            decode_into(&bytes, &settings(), &DecodeBudget::unlimited(), &mut out)
                .unwrap_or_else(|e| panic!("{format:?}: {e}"));
            let left = pixel(&out, 20, 100);
            let right = pixel(&out, 200, 100);
            assert!(left[0] > 200 && left[2] < 50, "{format:?} left {left:?}");
            assert!(
                right[2] > 200 && right[0] < 50,
                "{format:?} right {right:?}"
            );
        }
    }

    #[test]
    fn grey_and_alpha_images_become_rgb() {
        let grey = image::DynamicImage::ImageLuma8(image::GrayImage::from_pixel(
            50,
            40,
            image::Luma([77]),
        ));
        let rgba = image::DynamicImage::ImageRgba8(image::RgbaImage::from_pixel(
            50,
            40,
            image::Rgba([10, 200, 30, 0]),
        ));
        for (img, want) in [(grey.clone(), [77, 77, 77]), (rgba, [10, 200, 30])] {
            let mut out = vec![0; settings().row_len()];
            decode_into(
                &encode(img, ImageFormat::Png),
                &settings(),
                &DecodeBudget::unlimited(),
                &mut out,
            )
            .unwrap();
            assert_eq!(pixel(&out, 100, 100), want);
        }
        let mut out = vec![0; settings().row_len()];
        decode_into(
            &encode(grey, ImageFormat::Jpeg),
            &settings(),
            &DecodeBudget::unlimited(),
            &mut out,
        )
        .unwrap();
        let p = pixel(&out, 100, 100);
        assert!(p.iter().all(|&c| (c as i32 - 77).abs() <= 2), "{p:?}");
    }

    #[test]
    fn cmyk_jpeg_becomes_rgb() {
        // Written by Pillow: Image.new("CMYK", (64, 48), (0, 255, 255, 0)) is pure red.
        let bytes = include_bytes!("../../tests/fixtures/generated/red_cmyk.jpg");
        let mut out = vec![0; settings().row_len()];
        decode_into(bytes, &settings(), &DecodeBudget::unlimited(), &mut out).unwrap();
        let p = pixel(&out, 112, 112);
        assert!(p[0] > 230 && p[1] < 30 && p[2] < 30, "{p:?}");
    }

    #[test]
    fn a_progressive_jpeg_with_hundreds_of_scans_is_refused() {
        // tests/fixtures/make_scan_bomb.py: 4096x4096, 810 scans, 147 KB; seconds of CPU
        // to decode without the limit.
        let bytes = include_bytes!("../../tests/fixtures/generated/scan_bomb.jpg");
        let mut out = vec![0; settings().row_len()];
        let e = decode_into(bytes, &settings(), &DecodeBudget::unlimited(), &mut out).unwrap_err();
        assert_eq!(e.code(), "invalid_image");
        assert!(e.to_string().contains("scans"), "{e}");
        // An ordinary progressive JPEG (Pillow's, 10 scans) still decodes, also with a
        // motion photo's video (full of FF DA pairs) after its end.
        let ordinary = include_bytes!("../../tests/fixtures/generated/progressive.jpg");
        assert_eq!(jpeg::walk(ordinary, 100).scans, 10);
        let mut motion_photo = ordinary.to_vec();
        motion_photo.extend(std::iter::repeat_n([0xFF, 0xDA, 0x00, 0x04], 1000).flatten());
        assert_eq!(jpeg::walk(&motion_photo, 100).scans, 10);
        decode_into(
            &motion_photo,
            &settings(),
            &DecodeBudget::unlimited(),
            &mut out,
        )
        .unwrap();
        assert_eq!(
            jpeg::walk(bytes, 100).scans,
            101,
            "counting stops past the limit"
        );
    }

    #[test]
    fn bad_files_get_their_own_error_codes() {
        let mut out = vec![0; settings().row_len()];
        let mut run = |b: &[u8]| {
            decode_into(b, &settings(), &DecodeBudget::unlimited(), &mut out)
                .unwrap_err()
                .code()
        };
        assert_eq!(run(b""), "empty_file");
        assert_eq!(run(b"hello, this is text"), "invalid_image");
        let jpeg = encode(
            image::DynamicImage::ImageRgb8(halves(300, 200)),
            ImageFormat::Jpeg,
        );
        assert_eq!(run(&jpeg[..jpeg.len() / 2]), "invalid_image");
        assert_eq!(run(b"II*\0\x08\0\0\0rest of a tiff"), "unsupported_format");
    }

    #[test]
    fn pixel_limit_is_checked_from_the_header() {
        let small = PreprocessSettings {
            max_pixels: 1000,
            filter: Default::default(),
            ..settings()
        };
        let png = encode(
            image::DynamicImage::ImageRgb8(halves(100, 100)),
            ImageFormat::Png,
        );
        let mut out = vec![0; small.row_len()];
        let err = decode_into(&png, &small, &DecodeBudget::unlimited(), &mut out).unwrap_err();
        assert_eq!(err.code(), "image_too_large");
        // A header claiming 60000x60000 with no data behind it is refused before decoding.
        let mut jpeg = encode(
            image::DynamicImage::ImageRgb8(halves(16, 16)),
            ImageFormat::Jpeg,
        );
        let sof = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        jpeg[sof + 5..sof + 9].copy_from_slice(&[0xEA, 0x60, 0xEA, 0x60]);
        let err = decode_into(
            &jpeg,
            &settings(),
            &DecodeBudget::unlimited(),
            &mut out_for(&settings()),
        )
        .unwrap_err();
        assert_eq!(err.code(), "image_too_large", "{err}");
    }

    #[test]
    fn an_image_whose_decode_needs_more_than_the_budget_is_refused() {
        let mut out = out_for(&settings());
        let refused = |bytes: &[u8], budget: u64| {
            let limited = DecodeBudget::new(budget, None);
            let err = decode_into(bytes, &settings(), &limited, &mut vec![0; 224 * 224 * 3]);
            let err = err.err()?;
            assert_eq!(err.code(), "image_too_large", "{err}");
            assert!(err
                .to_string()
                .contains(&format!("budget of {budget} bytes")));
            Some(())
        };
        // 1000x1000 RGBA: 4 MB decoded plus its 3 MB RGB copy, and the resize's 1.3 MB.
        let rgba = encode(
            image::DynamicImage::ImageRgba8(image::RgbaImage::new(1000, 1000)),
            ImageFormat::Png,
        );
        assert!(refused(&rgba, 8_000_000).is_some());
        assert!(refused(&rgba, 8_400_000).is_none());
        // 64x48: a baseline JPEG needs its pixels and the resize's (84 KB); a progressive
        // one the DCT coefficients of every scan as well (18 KB more).
        let baseline = encode(
            image::DynamicImage::ImageRgb8(halves(64, 48)),
            ImageFormat::Jpeg,
        );
        let progressive = include_bytes!("../../tests/fixtures/generated/progressive.jpg");
        assert!(refused(&baseline, 90_000).is_none());
        assert!(refused(progressive, 90_000).is_some());
        decode_into(
            progressive,
            &settings(),
            &DecodeBudget::unlimited(),
            &mut out,
        )
        .unwrap();
    }

    fn out_for(s: &PreprocessSettings) -> Vec<u8> {
        vec![0; s.row_len()]
    }

    #[test]
    fn exif_orientation_is_applied() {
        // Red left / blue right, stored with orientation 6 ("rotate 90° clockwise to view"):
        // viewed, red is on top.
        let jpeg = encode(
            image::DynamicImage::ImageRgb8(halves(320, 240)),
            ImageFormat::Jpeg,
        );
        let with_exif = exif::tests::with_orientation(&jpeg, 6);
        let mut out = out_for(&settings());
        decode_into(
            &with_exif,
            &settings(),
            &DecodeBudget::unlimited(),
            &mut out,
        )
        .unwrap();
        let top = pixel(&out, 112, 20);
        let bottom = pixel(&out, 112, 200);
        assert!(top[0] > 200 && top[2] < 50, "top {top:?}");
        assert!(bottom[2] > 200 && bottom[0] < 50, "bottom {bottom:?}");
    }

    #[test]
    fn each_resize_filter_resamples_its_own_way() {
        // A 1-pixel checkerboard, 500 x 500: area averaging and antialiased bilinear give
        // mid-grey; interpolation without antialiasing samples the pattern.
        let (w, h) = (500u32, 500u32);
        let pixels: Vec<u8> = (0..w * h)
            .flat_map(|i| {
                let v = if (i % w + i / w) % 2 == 0 { 255 } else { 0 };
                [v, v, v]
            })
            .collect();
        let png = encode(
            image::DynamicImage::ImageRgb8(
                image::RgbImage::from_raw(w, h, pixels).expect("w x h x 3 bytes"),
            ),
            ImageFormat::Png,
        );
        let resize = |filter| {
            let settings = PreprocessSettings {
                filter,
                ..settings()
            };
            let mut out = vec![0u8; settings.row_len()];
            decode_into(&png, &settings, &DecodeBudget::unlimited(), &mut out).unwrap();
            out
        };
        let spread = |v: &[u8]| v.iter().map(|&p| (p as i32 - 128).abs()).max().unwrap();
        let (area, bilinear, linear) = (
            spread(&resize(ResizeFilter::Area)),
            spread(&resize(ResizeFilter::Bilinear)),
            spread(&resize(ResizeFilter::Linear)),
        );
        assert!(
            area <= 32 && bilinear <= 8 && linear > 100,
            "{area} {bilinear} {linear}"
        );
    }
}
