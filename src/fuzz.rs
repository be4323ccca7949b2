//! What the fuzz targets (`fuzz/`, cargo-fuzz) run: one function per input path a client
//! reaches, taking arbitrary bytes, each checking what must hold whatever the bytes are
//! (beyond "no panic, no unbounded allocation"). The targets call these and nothing else;
//! the unit test below replays the committed seed corpora, so `cargo test` runs them too.
use bytes::Bytes;
use prost::Message;

use crate::http::multipart::{Event, Malformed, Parser, PartHead};
use crate::kserve::{self, DataType, InputTensor};
use crate::preprocess::{self, DecodeBudget, PreprocessSettings};
use crate::repository;

/// A target: its name (its folder in `fuzz/seeds` and its binary in `fuzz/`) and what it runs.
pub type Target = (&'static str, fn(&[u8]));

pub const TARGETS: &[Target] = &[
    ("decode", decode),
    ("multipart", multipart),
    ("model_config", model_config),
    ("kserve_json", kserve_json),
    ("binary_tensors", binary_tensors),
    ("bytes_elements", bytes_elements),
    ("grpc_infer", grpc_infer),
];

/// Image decode through the public preprocess API (every format it accepts), at the
/// bundled model's size, with a budget so a header may ask for more than there is.
pub fn decode(data: &[u8]) {
    let settings = PreprocessSettings {
        width: 224,
        height: 224,
        dct_scaling_min_side: 224,
        max_pixels: 16_000_000,
        filter: Default::default(),
    };
    let budget = DecodeBudget::new(256 << 20, None);
    let mut row = vec![0u8; settings.row_len()];
    let _ = preprocess::decode_into(data, &settings, &budget, &mut row);
}

/// What a multipart body comes to: its parts with their whole content, whether the closing
/// boundary was read, and whether it was refused.
#[derive(Debug, PartialEq)]
struct Parsed {
    parts: Vec<(PartHead, Vec<u8>)>,
    done: bool,
    refused: bool,
}

fn parse_multipart(body: &[u8], chunk: usize) -> Parsed {
    let mut parser = Parser::new("vg-boundary", 8);
    let mut parsed = Parsed {
        parts: Vec::new(),
        done: false,
        refused: false,
    };
    let mut open = false;
    let mut step = |parser: &mut Parser, parsed: &mut Parsed| -> Result<(), Malformed> {
        while let Some(event) = parser.next_event()? {
            match event {
                Event::Part(head) => {
                    assert!(!open, "a part began inside a part");
                    open = true;
                    parsed.parts.push((head, Vec::new()));
                }
                Event::Data(bytes) => {
                    assert!(open, "content outside a part");
                    assert!(!bytes.is_empty(), "an empty Data event");
                    let part = parsed.parts.last_mut().expect("a part is open");
                    part.1.extend_from_slice(&bytes);
                }
                Event::PartEnd => {
                    assert!(open, "a part ended that had not begun");
                    open = false;
                }
            }
        }
        Ok(())
    };
    for piece in body.chunks(chunk.max(1)) {
        parser.feed(piece);
        if step(&mut parser, &mut parsed).is_err() {
            parsed.refused = true;
            return parsed;
        }
    }
    parsed.done = parser.is_done();
    // Parts still open at the end of the body are incomplete: not part of the result.
    if open {
        parsed.parts.pop();
    }
    parsed
}

/// The `/predict` body parser: fed the same body whole and in pieces (the piece size from
/// the first byte), it finds the same parts, with the same content, and refuses the same
/// bodies.
pub fn multipart(data: &[u8]) {
    let Some((&split, body)) = data.split_first() else {
        return;
    };
    let whole = parse_multipart(body, body.len());
    let pieces = parse_multipart(body, usize::from(split) % 64 + 1);
    assert_eq!(
        whole, pieces,
        "the result depends on how the body was split"
    );
}

/// `config.pbtxt` text: parsed, then (when it parses) mapped to Triton's JSON and read
/// back to the same config, then checked as a served model would be.
pub fn model_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = repository::parse_model_config("m", text) else {
        return;
    };
    let json = repository::model_config_json(&config).to_string();
    let again = repository::parse_model_config_json("m", &json).expect("its own JSON reads back");
    assert_eq!(config, again, "the JSON mapping changed the config");
    let dir = std::path::Path::new("/nonexistent/visiongate-fuzz/m");
    let _ = repository::model_kind(
        dir,
        "m",
        &config,
        crate::domain::ModelVersion(1),
        &repository::Limits::default(),
    );
}

/// An input as `kserve::infer` takes it, the way it does before any model runs: its size
/// against its shape, then its rows when it is image data.
fn check_input(input: &InputTensor) {
    if input.check_size().is_err() {
        return;
    }
    let limit = kserve::RowLimit {
        rows: usize::MAX,
        why: "fuzz",
        kind: crate::error::ErrorKind::InvalidInput,
    };
    if let Ok(rows) = kserve::image_rows(input, "m", limit) {
        let n = rows.count();
        assert_eq!(Some(n as i64), input.shape.first().copied());
    }
}

fn kserve_body(body: Bytes, header_len: Option<usize>) {
    let parsed = crate::http::v2_infer::parse_request("m".into(), body, header_len);
    if let Ok((parsed, _)) = parsed {
        parsed.request.inputs.iter().for_each(check_input);
    }
}

/// A KServe v2 JSON inference request (the whole body JSON).
pub fn kserve_json(data: &[u8]) {
    kserve_body(Bytes::copy_from_slice(data), None);
}

/// Triton's binary tensor extension: a JSON header (its length from the first two bytes,
/// as `Inference-Header-Content-Length`) and binary input data after it.
pub fn binary_tensors(data: &[u8]) {
    let Some((len, body)) = data.split_first_chunk::<2>() else {
        return;
    };
    let header_len = usize::from(u16::from_le_bytes(*len)) % (body.len() + 1);
    let body = Bytes::copy_from_slice(body);
    kserve_body(body, Some(header_len));
}

/// Raw BYTES tensor data: split into elements it encodes back to the same bytes, and an
/// input of that many elements passes its size check.
pub fn bytes_elements(data: &[u8]) {
    let Ok(n) = kserve::count_bytes_elements(data) else {
        return;
    };
    let elements: Vec<&[u8]> = kserve::bytes_elements(data).collect();
    assert_eq!(elements.len(), n);
    assert_eq!(kserve::encode_bytes_elements(elements), data);
    let input = InputTensor {
        name: "x".into(),
        datatype: DataType::Bytes,
        shape: vec![n as i64],
        data: Bytes::copy_from_slice(data),
        shared_memory: None,
    };
    input.check_size().expect("as many elements as its shape");
    check_input(&input);
}

/// A gRPC `ModelInferRequest` message (after its 5-byte frame): checked and decoded as the
/// service does, converted to the request `kserve::infer` takes.
pub fn grpc_infer(data: &[u8]) {
    if crate::grpc::check_infer_request(data).is_err() {
        return;
    }
    let Ok(request) = crate::grpc::pb::ModelInferRequest::decode(data) else {
        return;
    };
    if let Ok(request) = crate::grpc::convert::infer_request(request) {
        request.inputs.iter().for_each(check_input);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every seed of every target's committed corpus, run as the target runs it.
    #[test]
    fn every_seed_of_the_fuzz_corpora_runs() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
        for &(name, run) in super::TARGETS {
            let dir = root.join(name);
            let seeds: Vec<_> = std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .map(|e| e.unwrap().path())
                .collect();
            assert!(!seeds.is_empty(), "{name} has no seeds");
            for seed in seeds {
                run(&std::fs::read(&seed).unwrap());
            }
        }
    }
}
