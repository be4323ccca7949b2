//! EXIF orientation: read it (any container kamadak-exif knows: JPEG, PNG, WebP, TIFF)
//! and apply it to a packed RGB8 image.

/// The EXIF orientation (1..=8) of an encoded image; 1 when absent or unreadable.
pub fn orientation(bytes: &[u8]) -> u16 {
    let mut cursor = std::io::Cursor::new(bytes);
    let Ok(exif) = exif::Reader::new().read_from_container(&mut cursor) else {
        return 1;
    };
    exif.get_field(exif::Tag::Orientation, exif::In::PRIMARY)
        .and_then(|f| f.value.get_uint(0))
        .and_then(|v| u16::try_from(v).ok())
        .filter(|v| (1..=8).contains(v))
        .unwrap_or(1)
}

/// Writes `src` (`w`x`h`, as stored) into `dst` as it should be displayed. For
/// orientations 5-8 `dst` is `h`x`w`.
pub fn apply_orientation(src: &[u8], w: usize, h: usize, orientation: u16, dst: &mut [u8]) {
    debug_assert_eq!(src.len(), w * h * 3);
    debug_assert_eq!(dst.len(), w * h * 3);
    let (dw, dh) = if matches!(orientation, 5..=8) {
        (h, w)
    } else {
        (w, h)
    };
    for y in 0..dh {
        for x in 0..dw {
            // Source pixel shown at display position (x, y).
            let (sx, sy) = match orientation {
                2 => (w - 1 - x, y),
                3 => (w - 1 - x, h - 1 - y),
                4 => (x, h - 1 - y),
                5 => (y, x),
                6 => (y, h - 1 - x),
                7 => (w - 1 - y, h - 1 - x),
                8 => (w - 1 - y, x),
                _ => (x, y),
            };
            let s = (sy * w + sx) * 3;
            let d = (y * dw + x) * 3;
            dst[d..d + 3].copy_from_slice(&src[s..s + 3]);
        }
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// Inserts a minimal EXIF APP1 segment with the given orientation after the JPEG SOI.
    pub fn with_orientation(jpeg: &[u8], orientation: u16) -> Vec<u8> {
        let mut tiff = b"MM\0\x2a\0\0\0\x08".to_vec();
        tiff.extend_from_slice(&1u16.to_be_bytes()); // one IFD entry
        tiff.extend_from_slice(&0x0112u16.to_be_bytes()); // Orientation
        tiff.extend_from_slice(&3u16.to_be_bytes()); // SHORT
        tiff.extend_from_slice(&1u32.to_be_bytes()); // count
        tiff.extend_from_slice(&orientation.to_be_bytes());
        tiff.extend_from_slice(&[0, 0]);
        tiff.extend_from_slice(&0u32.to_be_bytes()); // no next IFD
        let mut payload = b"Exif\0\0".to_vec();
        payload.extend_from_slice(&tiff);
        let mut out = jpeg[..2].to_vec();
        out.extend_from_slice(&[0xFF, 0xE1]);
        out.extend_from_slice(&((payload.len() + 2) as u16).to_be_bytes());
        out.extend_from_slice(&payload);
        out.extend_from_slice(&jpeg[2..]);
        out
    }

    #[test]
    fn orientation_is_read_and_defaults_to_one() {
        let jpeg = [0xFF, 0xD8, 0xFF, 0xD9];
        assert_eq!(orientation(&jpeg), 1);
        assert_eq!(orientation(&with_orientation(&jpeg, 8)), 8);
        assert_eq!(orientation(b"garbage"), 1);
    }

    #[test]
    fn all_eight_orientations_map_corners_like_pillow_exif_transpose() {
        // 3x2 image whose pixels are numbered 0..6 in the red channel.
        let src: Vec<u8> = (0..6u8).flat_map(|i| [i, 0, 0]).collect();
        let reds = |o| {
            let mut dst = vec![0; 18];
            apply_orientation(&src, 3, 2, o, &mut dst);
            dst.chunks(3).map(|p| p[0]).collect::<Vec<_>>()
        };
        assert_eq!(reds(1), [0, 1, 2, 3, 4, 5]);
        assert_eq!(reds(2), [2, 1, 0, 5, 4, 3]);
        assert_eq!(reds(3), [5, 4, 3, 2, 1, 0]);
        assert_eq!(reds(4), [3, 4, 5, 0, 1, 2]);
        // 2x3 results, row by row.
        assert_eq!(reds(5), [0, 3, 1, 4, 2, 5]);
        assert_eq!(reds(6), [3, 0, 4, 1, 5, 2]);
        assert_eq!(reds(7), [5, 2, 4, 1, 3, 0]);
        assert_eq!(reds(8), [2, 5, 1, 4, 0, 3]);
    }
}
