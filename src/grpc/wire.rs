//! The gRPC codec: prost's, except that a `ModelInferRequest` is first read in its wire
//! form for what it will take once decoded and converted, and refused before prost builds
//! anything when that is out of proportion to its size (and a `TraceSettingRequest` over
//! 64 KiB is refused unread). A protobuf element can be tiny on
//! the wire and large in memory: an empty `bytes_contents` element is 2 bytes there and
//! about 40 decoded, a one-byte varint 8 bytes as an `int64`.
use std::any::TypeId;
use std::marker::PhantomData;

use bytes::Buf;
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

use super::pb;

/// A decoded request may take this many times its wire size, plus [`SLACK`].
const RATIO: usize = 3;
const SLACK: usize = 16 << 20;

/// The most bytes a trace settings request may have: a few settings of a few values each
/// take well under 1 KiB, and a map of tiny entries takes many times its wire size once
/// decoded.
const MAX_TRACE_SETTING_REQUEST: usize = 64 << 10;

/// The service's codec (named in `build.rs`).
pub struct CheckedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for CheckedCodec<T, U> {
    fn default() -> Self {
        CheckedCodec(PhantomData)
    }
}

impl<T, U> Codec for CheckedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(ProstDecoder::new(BufferSettings::default()))
    }
}

pub struct CheckedDecoder<U>(ProstDecoder<U>);

impl<U> Decoder for CheckedDecoder<U>
where
    U: Message + Default + Send + 'static,
{
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // The message is whole and in one piece here (tonic has read its length first).
        if TypeId::of::<U>() == TypeId::of::<pb::ModelInferRequest>()
            && buf.chunk().len() == buf.remaining()
        {
            check_infer_request(buf.chunk())?;
        }
        if TypeId::of::<U>() == TypeId::of::<pb::TraceSettingRequest>()
            && buf.remaining() > MAX_TRACE_SETTING_REQUEST
        {
            return Err(Status::invalid_argument(format!(
                "a trace settings request of {} bytes: at most {MAX_TRACE_SETTING_REQUEST} are \
                 taken",
                buf.remaining()
            )));
        }
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Refuses a `ModelInferRequest` whose decoded form, with its typed tensor contents
/// converted to raw bytes, would take more than [`RATIO`] times its size plus [`SLACK`].
/// Malformed wire data is left to prost, which refuses it.
pub fn check_infer_request(msg: &[u8]) -> Result<(), Status> {
    let Some(cost) = request_cost(msg) else {
        return Ok(());
    };
    let allowed = msg.len().saturating_mul(RATIO).saturating_add(SLACK);
    if cost > allowed {
        return Err(Status::invalid_argument(format!(
            "this {}-byte request would take about {cost} bytes once decoded (typed contents \
             and small elements cost more in memory than on the wire; at most {RATIO}x its \
             size + {} MiB is accepted): send tensor data in raw_input_contents",
            msg.len(),
            SLACK >> 20
        )));
    }
    Ok(())
}

/// A map entry (a `parameters` element): the key, the value and the map's own overhead.
const MAP_ENTRY: usize = 96;
/// A `Bytes` handle, and the 4-byte length each BYTES element gets in raw form.
const BYTES_ELEMENT: usize = size_of::<bytes::Bytes>() + 4;

/// One field of a message: its number and what it holds.
enum Field<'a> {
    Varint(u32),
    Fixed(u32),
    Len(u32, &'a [u8]),
}

/// The fields of a message in wire form; `None` where it is malformed.
fn fields(mut msg: &[u8]) -> impl Iterator<Item = Option<Field<'_>>> {
    std::iter::from_fn(move || {
        if msg.is_empty() {
            return None;
        }
        let field = (|| {
            let key = varint(&mut msg)?;
            let number = u32::try_from(key >> 3).ok()?;
            Some(match key & 7 {
                0 => {
                    varint(&mut msg)?;
                    Field::Varint(number)
                }
                1 | 5 => {
                    let n = if key & 7 == 1 { 8 } else { 4 };
                    msg = msg.get(n..)?;
                    Field::Fixed(number)
                }
                2 => {
                    let len = usize::try_from(varint(&mut msg)?).ok()?;
                    let (body, rest) = (msg.get(..len)?, msg.get(len..)?);
                    msg = rest;
                    Field::Len(number, body)
                }
                _ => return None,
            })
        })();
        if field.is_none() {
            msg = &[];
            return Some(None);
        }
        Some(field)
    })
}

fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        value |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Some(value);
        }
    }
    None
}

/// The bytes `msg` takes decoded, and converted where it carries typed contents.
fn request_cost(msg: &[u8]) -> Option<usize> {
    let mut cost = size_of::<pb::ModelInferRequest>();
    for field in fields(msg) {
        cost += match field? {
            Field::Len(1..=3, s) => s.len(),
            Field::Len(4, s) => MAP_ENTRY + s.len(),
            Field::Len(5, input) => {
                2 * size_of::<pb::model_infer_request::InferInputTensor>() + input_cost(input)?
            }
            Field::Len(6, output) => {
                2 * size_of::<pb::model_infer_request::InferRequestedOutputTensor>()
                    + MAP_ENTRY
                        * fields(output)
                            .filter(|f| matches!(f, Some(Field::Len(2, _))))
                            .count()
                    + output.len()
            }
            Field::Len(7, _) => 2 * size_of::<bytes::Bytes>(),
            _ => 0,
        };
    }
    Some(cost)
}

fn input_cost(input: &[u8]) -> Option<usize> {
    let mut cost = 0;
    for field in fields(input) {
        cost += match field? {
            Field::Len(1 | 2, s) => s.len(),
            Field::Len(3, packed) => 2 * 8 * varints(packed),
            Field::Varint(3) => 2 * 8,
            Field::Len(4, s) => MAP_ENTRY + s.len(),
            Field::Len(5, contents) => contents_cost(contents)?,
            _ => 0,
        };
    }
    Some(cost)
}

/// Typed contents: each element decoded (its `Vec` may grow to twice its length) and in
/// raw form.
fn contents_cost(contents: &[u8]) -> Option<usize> {
    // Decoded and raw bytes of one element of field 1..=7.
    let element = |number: u32| -> usize {
        match number {
            1 => 2 + 1,
            2 | 4 | 6 => 2 * 4 + 4,
            _ => 2 * 8 + 8,
        }
    };
    let mut cost = 0;
    for field in fields(contents) {
        cost += match field? {
            Field::Len(8, s) => 2 * BYTES_ELEMENT + s.len(),
            Field::Len(n @ (6 | 7), packed) => {
                element(n) * (packed.len() / if n == 6 { 4 } else { 8 })
            }
            Field::Len(n @ 1..=5, packed) => element(n) * varints(packed),
            Field::Varint(n @ 1..=5) | Field::Fixed(n @ (6 | 7)) => element(n),
            _ => 0,
        };
    }
    Some(cost)
}

/// Varints in a packed field: one per byte that ends one.
fn varints(packed: &[u8]) -> usize {
    packed.iter().filter(|&&b| b < 0x80).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(contents: pb::InferTensorContents, raw: Vec<bytes::Bytes>) -> Vec<u8> {
        pb::ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![pb::model_infer_request::InferInputTensor {
                name: "x".into(),
                datatype: "BYTES".into(),
                shape: vec![1],
                contents: (raw.is_empty()).then_some(contents),
                ..Default::default()
            }],
            raw_input_contents: raw,
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn small_elements_in_bulk_are_refused_and_raw_or_float_contents_pass() {
        // 8 M empty BYTES elements: 16 MB on the wire, ~700 MB decoded.
        let empty = pb::InferTensorContents {
            bytes_contents: vec![bytes::Bytes::new(); 8 << 20],
            ..Default::default()
        };
        let e = check_infer_request(&request(empty, vec![])).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains("raw_input_contents"),
            "{}",
            e.message()
        );
        // 4 M one-byte int64 varints: 4 MB on the wire, ~100 MB as i64 and raw.
        let ints = pb::InferTensorContents {
            int64_contents: vec![1; 4 << 20],
            ..Default::default()
        };
        assert!(check_infer_request(&request(ints, vec![])).is_err());
        // The same count of FP32 values, or one large raw tensor, pass.
        let floats = pb::InferTensorContents {
            fp32_contents: vec![0.5; 4 << 20],
            ..Default::default()
        };
        assert!(check_infer_request(&request(floats, vec![])).is_ok());
        let raw = vec![bytes::Bytes::from(vec![7u8; 32 << 20])];
        assert!(check_infer_request(&request(Default::default(), raw)).is_ok());
        // A few images as BYTES elements pass.
        let images = pb::InferTensorContents {
            bytes_contents: vec![bytes::Bytes::from(vec![1u8; 100_000]); 8],
            ..Default::default()
        };
        assert!(check_infer_request(&request(images, vec![])).is_ok());
    }
}
