//! A decode reserves from the decode budget, before any pixel buffer exists, what it will
//! allocate (`--decode-memory-bytes` holds only as long as that estimate does). For each
//! kind of PNG, GIF, BMP and WebP, the most heap memory a decode held at once is at most
//! what it reserved; the reservation is read from the refusal a one-byte budget gives.
//! Measured by counting this test binary's allocations. JPEG is not here: libjpeg-turbo
//! allocates through C `malloc`, which this counter does not see (its estimate is
//! libjpeg's documented buffers, tested by the decode memory test in tests/python).
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Cursor;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use image::{DynamicImage, ImageFormat, Rgba, RgbaImage};
use visiongate::preprocess::{decode_into, DecodeBudget, PreprocessError, PreprocessSettings};

/// Bytes allocated now, and the most since `PEAK` was last set.
static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        NOW.fetch_sub(layout.size(), SeqCst);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        if size > layout.size() {
            grew(size - layout.size());
        } else {
            NOW.fetch_sub(layout.size() - size, SeqCst);
        }
        System.realloc(ptr, layout, size)
    }
}

fn grew(bytes: usize) {
    let now = NOW.fetch_add(bytes, SeqCst) + bytes;
    PEAK.fetch_max(now, SeqCst);
}

#[global_allocator]
static COUNTING: Counting = Counting;

const SIDE: u32 = 2048;

/// Noise, so that compressed data is as large as it gets; `alpha` varies across the image.
fn noise(alpha: bool) -> RgbaImage {
    let mut x = 0x2545_f491_u32;
    RgbaImage::from_fn(SIDE, SIDE, |col, _| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let [r, g, b, _] = x.to_le_bytes();
        Rgba([r, g, b, if alpha { (col % 256) as u8 } else { 255 }])
    })
}

fn encode(img: DynamicImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, format).unwrap();
    out.into_inner()
}

fn lossless_webp(img: RgbaImage) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::webp::WebPEncoder::new_lossless(&mut out)
        .encode(img.as_raw(), SIDE, SIDE, image::ExtendedColorType::Rgba8)
        .unwrap();
    out
}

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/generated/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e} (tests/fixtures/make_webp.py)"))
}

/// The most heap memory decoding `bytes` held at once, and what it reserved.
fn peak_and_reserved(bytes: &[u8]) -> (u64, u64) {
    let settings = PreprocessSettings {
        width: 224,
        height: 224,
        dct_scaling_min_side: 224,
        max_pixels: 1 << 26,
        filter: Default::default(),
    };
    let mut out = vec![0u8; settings.row_len()];
    let reserved = match decode_into(bytes, &settings, &DecodeBudget::new(1, None), &mut out) {
        Err(PreprocessError::OverBudget { bytes, .. }) => bytes,
        other => panic!("a one-byte budget refuses the decode: {other:?}"),
    };
    let budget = DecodeBudget::unlimited();
    let before = NOW.load(SeqCst);
    PEAK.store(before, SeqCst);
    decode_into(bytes, &settings, &budget, &mut out).unwrap();
    ((PEAK.load(SeqCst) - before) as u64, reserved)
}

#[test]
fn every_decode_holds_at_most_what_it_reserved() {
    let opaque = noise(false);
    let translucent = noise(true);
    let rgb = DynamicImage::ImageRgba8(opaque.clone()).into_rgb8();
    let images = [
        ("PNG RGB8", encode(rgb.clone().into(), ImageFormat::Png)),
        (
            "PNG RGBA8",
            encode(translucent.clone().into(), ImageFormat::Png),
        ),
        (
            "PNG RGBA16",
            encode(
                DynamicImage::ImageRgba8(translucent.clone())
                    .into_rgba16()
                    .into(),
                ImageFormat::Png,
            ),
        ),
        (
            "PNG L8",
            encode(
                DynamicImage::ImageRgb8(rgb.clone()).into_luma8().into(),
                ImageFormat::Png,
            ),
        ),
        ("GIF", encode(rgb.clone().into(), ImageFormat::Gif)),
        ("BMP", encode(rgb.into(), ImageFormat::Bmp)),
        ("WebP lossless", lossless_webp(opaque)),
        ("WebP lossless alpha", lossless_webp(translucent)),
        ("WebP lossy", fixture("webp_lossy.webp")),
        ("WebP lossy alpha", fixture("webp_lossy_alpha.webp")),
        ("WebP animated", fixture("webp_animated.webp")),
    ];
    let pixels = f64::from(SIDE * SIDE);
    let mut over = Vec::new();
    for (kind, bytes) in &images {
        let (peak, reserved) = peak_and_reserved(bytes);
        println!(
            "{kind:20} {:6} KiB file, held {:5.2} bytes a pixel, reserved {:5.2}",
            bytes.len() >> 10,
            peak as f64 / pixels,
            reserved as f64 / pixels
        );
        if peak > reserved {
            over.push(format!("{kind}: held {peak} bytes, reserved {reserved}"));
        }
    }
    assert!(
        over.is_empty(),
        "decodes held more than they reserved: {over:#?}"
    );
}
