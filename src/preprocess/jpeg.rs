//! A JPEG's structure, read from its marker segments without decoding anything: its frame
//! (coding process, sample precision, components and their sampling factors), the colour
//! transform its APP14 (Adobe) segment names, whether it has a JFIF segment, how many scans
//! it has and whether it ends. The CPU decoder bounds its scans by it; the GPU decoder takes
//! only the JPEGs whose structure it decodes (`gpu_fallback` says why not), so that a file
//! it would refuse is sent to the CPU before its batch, not after.

/// What one walk over a JPEG's segments found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JpegStructure {
    /// The frame header (SOFn) before the first scan, if any.
    pub frame: Option<Frame>,
    /// The APP14 "Adobe" segment's colour transform (0: none, 1: YCbCr, 2: YCCK).
    pub adobe_transform: Option<u8>,
    /// Whether an APP0 "JFIF" segment is present (the components are then YCbCr or grey).
    pub jfif: bool,
    /// SOS segments, counted up to the walk's limit (one past it at most).
    pub scans: usize,
    /// Whether the walk reached EOI.
    pub ended: bool,
    /// Why the walk stopped early: a segment's length runs past the file or is below 2, a
    /// scan comes before any frame header, or the file does not start with SOI.
    pub broken: Option<&'static str>,
}

/// A JPEG frame header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The SOF marker's low nibble: 0 baseline, 1 extended sequential, 2 progressive,
    /// 3 lossless, 5-7 hierarchical, 9-15 their arithmetic-coded forms.
    pub process: u8,
    pub precision: u8,
    pub width: u16,
    /// 0 when the height is given later by a DNL segment.
    pub height: u16,
    /// Each component's identifier and horizontal and vertical sampling factors, the first
    /// four (a frame with more is refused by every decoder).
    pub components: Vec<(u8, u8, u8)>,
    /// How many components the frame declares.
    pub component_count: u8,
}

/// Why an image is decoded on the CPU rather than by the GPU decoder: each a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuReason {
    /// The model's instances do not run on a GPU, GPU decoding is turned off, or the host
    /// has no GPU decoder.
    NoGpuDecoder,
    /// PNG, WebP, BMP or GIF.
    NotJpeg,
    Progressive,
    Lossless,
    Hierarchical,
    Arithmetic,
    /// 12- or 16-bit samples.
    Precision,
    /// CMYK, YCCK, or RGB stored without the YCbCr transform.
    Colorspace,
    /// 4:1:1, 4:1:0, or sampling factors of no standard layout.
    Subsampling,
    /// A sequential JPEG whose components come in separate scans.
    MultiScan,
    /// The structure is broken or incomplete (truncated, no frame, no scan, no EOI, a
    /// height given by DNL): libjpeg-turbo decodes what it can or says what is wrong.
    Damaged,
    /// The preprocessor resizes with a filter the GPU path does not have (`area`).
    ResizeFilter,
    /// The CPU path decodes it at 1/2, 1/4 or 1/8 scale (`dct_scaling_min_side`). nvJPEG's
    /// hardware decoder, asked for those scales, gave other pixels on an H200 (docs/
    /// performance.md), so such JPEGs are decoded here, where every path decodes them alike.
    DctScale,
    /// The GPU decoder refused or failed it at decode time (its batch, then it alone).
    GpuFailed,
}

impl CpuReason {
    pub fn label(self) -> &'static str {
        match self {
            CpuReason::NoGpuDecoder => "no_gpu_decoder",
            CpuReason::NotJpeg => "not_jpeg",
            CpuReason::Progressive => "progressive",
            CpuReason::Lossless => "lossless",
            CpuReason::Hierarchical => "hierarchical",
            CpuReason::Arithmetic => "arithmetic",
            CpuReason::Precision => "precision",
            CpuReason::Colorspace => "colorspace",
            CpuReason::Subsampling => "subsampling",
            CpuReason::MultiScan => "multi_scan",
            CpuReason::Damaged => "damaged",
            CpuReason::ResizeFilter => "resize_filter",
            CpuReason::DctScale => "dct_scale",
            CpuReason::GpuFailed => "gpu_failed",
        }
    }

    pub const ALL: [CpuReason; 14] = [
        CpuReason::NoGpuDecoder,
        CpuReason::NotJpeg,
        CpuReason::Progressive,
        CpuReason::Lossless,
        CpuReason::Hierarchical,
        CpuReason::Arithmetic,
        CpuReason::Precision,
        CpuReason::Colorspace,
        CpuReason::Subsampling,
        CpuReason::MultiScan,
        CpuReason::Damaged,
        CpuReason::ResizeFilter,
        CpuReason::DctScale,
        CpuReason::GpuFailed,
    ];
}

/// Walks `b`'s marker segments from SOI to EOI: segments are skipped by their length (an
/// EXIF thumbnail's markers are not read), scan data up to the next marker other than a
/// stuffed 00 or RSTn, and what follows EOI (a motion photo's video) is not read. Stops
/// once more than `scan_limit` scans are counted, so a scan bomb costs one pass at most.
pub fn walk(b: &[u8], scan_limit: usize) -> JpegStructure {
    let mut s = JpegStructure::default();
    if !b.starts_with(&[0xFF, 0xD8]) {
        s.broken = Some("no SOI marker");
        return s;
    }
    let mut i = 2;
    while i + 1 < b.len() && s.scans <= scan_limit {
        if b[i] != 0xFF {
            i += 1;
            continue;
        }
        let marker = b[i + 1];
        match marker {
            0xFF => i += 1, // fill byte
            0xD9 => {
                s.ended = true;
                break;
            }
            0x01 | 0xD0..=0xD7 => i += 2,
            _ => {
                let Some(length) = b.get(i + 2..i + 4) else {
                    s.broken = Some("a segment's length is cut off");
                    break;
                };
                let length = u16::from_be_bytes([length[0], length[1]]) as usize;
                let Some(body) = b.get(i + 4..i + 2 + length).filter(|_| length >= 2) else {
                    s.broken = Some("a segment runs past the end of the file");
                    break;
                };
                i += 2 + length;
                match marker {
                    0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) && s.frame.is_none() => {
                        s.frame = frame(marker & 0x0F, body);
                        if s.frame.is_none() {
                            s.broken = Some("the frame header is cut off");
                            break;
                        }
                    }
                    0xE0 if body.starts_with(b"JFIF\0") => s.jfif = true,
                    0xEE if body.len() >= 12 && body.starts_with(b"Adobe") => {
                        s.adobe_transform = Some(body[11]);
                    }
                    0xDA => {
                        if s.frame.is_none() {
                            s.broken = Some("a scan comes before the frame header");
                            break;
                        }
                        s.scans += 1;
                        while i + 1 < b.len()
                            && !(b[i] == 0xFF
                                && b[i + 1] != 0
                                && !(0xD0..=0xD7).contains(&b[i + 1]))
                        {
                            i += 1;
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    s
}

fn frame(process: u8, body: &[u8]) -> Option<Frame> {
    let &[precision, h0, h1, w0, w1, count, ref rest @ ..] = body else {
        return None;
    };
    let components = rest
        .chunks_exact(3)
        .take(usize::from(count).min(4))
        .map(|c| (c[0], c[1] >> 4, c[1] & 0x0F))
        .collect::<Vec<_>>();
    (components.len() == usize::from(count).min(4)).then_some(Frame {
        process,
        precision,
        width: u16::from_be_bytes([w0, w1]),
        height: u16::from_be_bytes([h0, h1]),
        components,
        component_count: count,
    })
}

/// Why the GPU decoder (nvJPEG's hardware backend, and its GPU-assisted one held to the
/// same rules) does not take a JPEG of this structure; `None` when it does: a sequential
/// Huffman-coded 8-bit frame of one (grey) or three YCbCr components in 4:4:4, 4:2:2,
/// 4:2:0 or 4:4:0, in one interleaved scan, complete.
pub fn gpu_fallback(s: &JpegStructure) -> Option<CpuReason> {
    let Some(frame) = s.frame.as_ref().filter(|_| s.broken.is_none()) else {
        return Some(CpuReason::Damaged);
    };
    match frame.process {
        0 | 1 => {}
        2 => return Some(CpuReason::Progressive),
        3 => return Some(CpuReason::Lossless),
        5..=7 => return Some(CpuReason::Hierarchical),
        _ => return Some(CpuReason::Arithmetic),
    }
    if frame.precision != 8 {
        return Some(CpuReason::Precision);
    }
    match frame.component_count {
        1 => {}
        3 => {
            let ids: Vec<u8> = frame.components.iter().map(|c| c.0).collect();
            // libjpeg's rule: RGB when Adobe says no transform, or with neither JFIF nor
            // Adobe segment when the identifiers spell R, G, B.
            let rgb = s.adobe_transform == Some(0)
                || (s.adobe_transform.is_none() && !s.jfif && ids == b"RGB");
            if rgb {
                return Some(CpuReason::Colorspace);
            }
            let luma = (frame.components[0].1, frame.components[0].2);
            let chroma_plain = frame.components[1..].iter().all(|c| (c.1, c.2) == (1, 1));
            if !chroma_plain || !matches!(luma, (1, 1) | (2, 1) | (2, 2) | (1, 2)) {
                return Some(CpuReason::Subsampling);
            }
        }
        _ => return Some(CpuReason::Colorspace),
    }
    if frame.height == 0 || frame.width == 0 || s.scans == 0 || !s.ended {
        return Some(CpuReason::Damaged);
    }
    if s.scans > 1 {
        return Some(CpuReason::MultiScan);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JPEG's segments, made by hand: SOI, the optional APP segments, a frame header
    /// with `process` and `components` (id, h, v), `scans` scans of a few data bytes each
    /// (one with a stuffed 0xFF00 and an RST marker), EOI when `end`.
    fn jpeg(
        process: u8,
        precision: u8,
        components: &[(u8, u8, u8)],
        app: &[u8],
        scans: usize,
        end: bool,
    ) -> Vec<u8> {
        let mut b = vec![0xFF, 0xD8];
        b.extend_from_slice(app);
        let mut sof = vec![precision, 0x01, 0xE0, 0x02, 0x80, components.len() as u8];
        for &(id, h, v) in components {
            sof.extend_from_slice(&[id, (h << 4) | v, 0]);
        }
        b.extend_from_slice(&[0xFF, 0xC0 | process]);
        b.extend_from_slice(&(sof.len() as u16 + 2).to_be_bytes());
        b.extend_from_slice(&sof);
        for _ in 0..scans {
            b.extend_from_slice(&[0xFF, 0xDA, 0x00, 0x08, 1, 1, 0, 0, 63, 0]);
            b.extend_from_slice(&[0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD0, 0x56]);
        }
        if end {
            b.extend_from_slice(&[0xFF, 0xD9]);
        }
        b
    }

    const YCC420: &[(u8, u8, u8)] = &[(1, 2, 2), (2, 1, 1), (3, 1, 1)];

    fn segment(marker: u8, body: &[u8]) -> Vec<u8> {
        let mut s = vec![0xFF, marker];
        s.extend_from_slice(&(body.len() as u16 + 2).to_be_bytes());
        s.extend_from_slice(body);
        s
    }

    fn adobe(transform: u8) -> Vec<u8> {
        segment(
            0xEE,
            &[b'A', b'd', b'o', b'b', b'e', 0, 100, 0, 0, 0, 0, transform],
        )
    }

    fn reason(bytes: &[u8]) -> Option<CpuReason> {
        gpu_fallback(&walk(bytes, 100))
    }

    #[test]
    fn baseline_and_extended_ycbcr_in_the_usual_samplings_go_to_the_gpu() {
        let jfif = segment(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
        for luma in [(1, 1), (2, 1), (2, 2), (1, 2)] {
            let c = [(1, luma.0, luma.1), (2, 1, 1), (3, 1, 1)];
            for process in [0, 1] {
                assert_eq!(
                    reason(&jpeg(process, 8, &c, &jfif, 1, true)),
                    None,
                    "{luma:?}"
                );
            }
        }
        // Grey, and YCbCr said so by Adobe's transform 1.
        assert_eq!(reason(&jpeg(0, 8, &[(1, 1, 1)], &[], 1, true)), None);
        assert_eq!(reason(&jpeg(0, 8, YCC420, &adobe(1), 1, true)), None);
        let s = walk(&jpeg(0, 8, YCC420, &jfif, 1, true), 100);
        let f = s.frame.unwrap();
        assert_eq!(
            (f.width, f.height, s.scans, s.jfif, s.ended),
            (640, 480, 1, true, true)
        );
    }

    #[test]
    fn each_structure_the_gpu_decoder_refuses_goes_to_the_cpu_with_its_reason() {
        use CpuReason::*;
        let cases: Vec<(Vec<u8>, CpuReason)> = vec![
            (jpeg(2, 8, YCC420, &[], 9, true), Progressive),
            (jpeg(3, 8, YCC420, &[], 1, true), Lossless),
            (jpeg(5, 8, YCC420, &[], 1, true), Hierarchical),
            (jpeg(9, 8, YCC420, &[], 1, true), Arithmetic),
            (jpeg(10, 8, YCC420, &[], 9, true), Arithmetic),
            (jpeg(1, 12, YCC420, &[], 1, true), Precision),
            (
                jpeg(
                    0,
                    8,
                    &[(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1)],
                    &adobe(2),
                    1,
                    true,
                ),
                Colorspace,
            ),
            (
                jpeg(
                    0,
                    8,
                    &[(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1)],
                    &[],
                    1,
                    true,
                ),
                Colorspace,
            ),
            (jpeg(0, 8, YCC420, &adobe(0), 1, true), Colorspace),
            (
                jpeg(
                    0,
                    8,
                    &[(b'R', 1, 1), (b'G', 1, 1), (b'B', 1, 1)],
                    &[],
                    1,
                    true,
                ),
                Colorspace,
            ),
            (
                jpeg(0, 8, &[(1, 1, 1), (2, 1, 1)], &[], 1, true),
                Colorspace,
            ),
            (
                jpeg(0, 8, &[(1, 4, 1), (2, 1, 1), (3, 1, 1)], &[], 1, true),
                Subsampling,
            ),
            (
                jpeg(0, 8, &[(1, 4, 2), (2, 1, 1), (3, 1, 1)], &[], 1, true),
                Subsampling,
            ),
            (
                jpeg(0, 8, &[(1, 2, 2), (2, 2, 1), (3, 1, 1)], &[], 1, true),
                Subsampling,
            ),
            (
                jpeg(0, 8, &[(1, 3, 1), (2, 1, 1), (3, 1, 1)], &[], 1, true),
                Subsampling,
            ),
            (jpeg(0, 8, YCC420, &[], 3, true), MultiScan),
            (jpeg(0, 8, YCC420, &[], 1, false), Damaged),
            (jpeg(0, 8, YCC420, &[], 0, true), Damaged),
        ];
        for (i, (bytes, want)) in cases.iter().enumerate() {
            assert_eq!(reason(bytes), Some(*want), "case {i}");
        }
        // RGB identifiers with a JFIF segment are YCbCr (JFIF says so).
        let jfif = segment(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
        let rgb_ids = [(b'R', 1, 1), (b'G', 1, 1), (b'B', 1, 1)];
        assert_eq!(reason(&jpeg(0, 8, &rgb_ids, &jfif, 1, true)), None);
    }

    #[test]
    fn broken_structures_are_damaged_and_the_walk_stops_there() {
        let good = jpeg(0, 8, YCC420, &[], 1, true);
        // Cut inside the frame header, inside a segment's length, and a scan with no frame.
        for cut in [5, 8, 12] {
            let s = walk(&good[..cut], 100);
            assert_eq!(gpu_fallback(&s), Some(CpuReason::Damaged), "cut at {cut}");
        }
        let mut no_frame = vec![0xFF, 0xD8];
        no_frame.extend_from_slice(&[0xFF, 0xDA, 0x00, 0x08, 1, 1, 0, 0, 63, 0, 0xFF, 0xD9]);
        let s = walk(&no_frame, 100);
        assert_eq!(s.broken, Some("a scan comes before the frame header"));
        // A length below 2, and a file that is not a JPEG at all.
        let mut short = vec![0xFF, 0xD8, 0xFF, 0xE1, 0x00, 0x01];
        short.extend_from_slice(&good[2..]);
        assert!(walk(&short, 100).broken.is_some());
        assert_eq!(walk(b"\x89PNG", 100).broken, Some("no SOI marker"));
        // A height left to a DNL segment.
        let mut dnl = good.clone();
        dnl[7..9].copy_from_slice(&[0, 0]);
        assert_eq!(walk(&dnl, 100).frame.unwrap().height, 0);
        assert_eq!(reason(&dnl), Some(CpuReason::Damaged));
    }

    #[test]
    fn markers_inside_segments_and_after_eoi_are_not_read() {
        // An APP1 segment holding a whole JPEG (an EXIF thumbnail) with its own scans, and a
        // second image after EOI (a motion photo's trailer).
        let inner = jpeg(2, 8, YCC420, &[], 5, true);
        let mut outer = vec![0xFF, 0xD8];
        outer.extend_from_slice(&segment(0xE1, &inner));
        outer.extend_from_slice(&jpeg(0, 8, YCC420, &[], 1, true)[2..]);
        outer.extend_from_slice(&inner);
        let s = walk(&outer, 100);
        assert_eq!((s.scans, s.frame.as_ref().unwrap().process), (1, 0));
        assert_eq!(gpu_fallback(&s), None);
    }

    #[test]
    fn the_walk_stops_one_scan_past_its_limit() {
        assert_eq!(walk(&jpeg(2, 8, YCC420, &[], 500, true), 10).scans, 11);
    }

    #[test]
    fn the_bundled_photos_go_to_the_gpu_and_pillows_progressive_and_cmyk_files_do_not() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/photos");
        let mut seen = 0;
        for size in ["small", "medium", "large"] {
            for entry in std::fs::read_dir(dir.join(size)).unwrap() {
                let bytes = std::fs::read(entry.unwrap().path()).unwrap();
                assert_eq!(reason(&bytes), None);
                seen += 1;
            }
        }
        assert_eq!(seen, 40);
        // Files written by Pillow (tests/fixtures/generated): progressive, and CMYK (Adobe).
        let generated = dir.parent().unwrap().join("generated");
        for (file, want) in [
            ("progressive.jpg", CpuReason::Progressive),
            ("scan_bomb.jpg", CpuReason::Progressive),
            ("red_cmyk.jpg", CpuReason::Colorspace),
        ] {
            let bytes = std::fs::read(generated.join(file)).unwrap();
            assert_eq!(reason(&bytes), Some(want), "{file}");
        }
    }
}
