//! Wire messages <-> `kserve` types. Typed `contents` are converted to the raw layout, so
//! inference sees one form whichever way the client sent its tensors.
use std::collections::HashMap;

use bytes::Bytes;

use super::pb;
use crate::error::GatewayError;
use crate::kserve::{self, DataType, InputTensor, Param, Params};

fn invalid(message: String) -> GatewayError {
    GatewayError::invalid(message)
}

/// A protobuf parameter map as KServe's transport-neutral `Params` (a parameter without a
/// value is left out).
fn params(map: HashMap<String, pb::InferParameter>) -> Params {
    use pb::infer_parameter::ParameterChoice as P;
    map.into_iter()
        .filter_map(|(name, p)| {
            let value = match p.parameter_choice? {
                P::BoolParam(v) => Param::Bool(v),
                P::Int64Param(v) => Param::Int(v),
                P::Uint64Param(v) => Param::Uint(v),
                P::DoubleParam(v) => Param::Double(v),
                P::StringParam(v) => Param::Text(v),
            };
            Some((name, value))
        })
        .collect()
}

/// The request for `kserve::infer`.
pub fn infer_request(req: pb::ModelInferRequest) -> Result<kserve::InferRequest, GatewayError> {
    let raw = req.raw_input_contents;
    // Raw contents pair, in order, with the inputs that are not in shared memory.
    let mut inputs = Vec::with_capacity(req.inputs.len());
    let mut places = Vec::with_capacity(req.inputs.len());
    for mut input in req.inputs {
        places.push(params(std::mem::take(&mut input.parameters)).shared_memory(&input.name)?);
        inputs.push(input);
    }
    let sent = places.iter().filter(|p| p.is_none()).count();
    if !raw.is_empty() && raw.len() != sent {
        return Err(invalid(format!(
            "raw_input_contents has {} entries for {sent} inputs not in shared memory; give \
             one per input, in order",
            raw.len(),
        )));
    }
    let mut raw = raw.into_iter();
    let inputs = inputs
        .into_iter()
        .zip(places)
        .map(|(input, place)| {
            let datatype = DataType::parse(&input.datatype)
                .map_err(|e| invalid(format!("input '{}': {e}", input.name)))?;
            let data = match (&place, input.contents) {
                (Some(_), Some(_)) => {
                    return Err(invalid(format!(
                        "input '{}' has contents and is in shared memory; use one",
                        input.name
                    )))
                }
                (Some(_), None) => Bytes::new(),
                (None, contents) => match (raw.next(), contents) {
                    (Some(_), Some(_)) => {
                        return Err(invalid(format!(
                            "input '{}' has contents and raw_input_contents; use one",
                            input.name
                        )))
                    }
                    (Some(raw), None) => raw,
                    (None, Some(contents)) => contents_to_raw(contents, datatype)
                        .map_err(|e| invalid(format!("input '{}': {e}", input.name)))?,
                    (None, None) => {
                        return Err(invalid(format!("input '{}' has no data", input.name)))
                    }
                },
            };
            Ok(InputTensor {
                name: input.name,
                datatype,
                shape: input.shape,
                data,
                shared_memory: place,
            })
        })
        .collect::<Result<Vec<_>, GatewayError>>()?;
    let outputs = req
        .outputs
        .into_iter()
        .map(|o| params(o.parameters).requested_output(o.name))
        .collect::<Result<Vec<_>, GatewayError>>()?;
    Ok(kserve::InferRequest {
        model: req.model_name,
        id: req.id,
        inputs,
        outputs,
        options: params(req.parameters).request_options()?,
    })
}

/// Typed contents in raw little-endian form; the list must match the datatype.
fn contents_to_raw(c: pb::InferTensorContents, datatype: DataType) -> Result<Bytes, String> {
    fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }
    let narrow = |v: &[u32], max: u32| -> Result<(), String> {
        match v.iter().find(|&&x| x > max) {
            Some(x) => Err(format!("value {x} does not fit {datatype}")),
            None => Ok(()),
        }
    };
    let narrow_i = |v: &[i32], min: i32, max: i32| -> Result<(), String> {
        match v.iter().find(|&&x| x < min || x > max) {
            Some(x) => Err(format!("value {x} does not fit {datatype}")),
            None => Ok(()),
        }
    };
    let raw: Vec<u8> = match datatype {
        DataType::Bool => c.bool_contents.iter().map(|&b| u8::from(b)).collect(),
        DataType::Uint8 => {
            narrow(&c.uint_contents, u8::MAX as u32)?;
            c.uint_contents.iter().map(|&x| x as u8).collect()
        }
        DataType::Uint16 => {
            narrow(&c.uint_contents, u16::MAX as u32)?;
            le(&c.uint_contents, |x| (x as u16).to_le_bytes())
        }
        DataType::Uint32 => le(&c.uint_contents, u32::to_le_bytes),
        DataType::Uint64 => le(&c.uint64_contents, u64::to_le_bytes),
        DataType::Int8 => {
            narrow_i(&c.int_contents, i8::MIN as i32, i8::MAX as i32)?;
            c.int_contents.iter().map(|&x| x as i8 as u8).collect()
        }
        DataType::Int16 => {
            narrow_i(&c.int_contents, i16::MIN as i32, i16::MAX as i32)?;
            le(&c.int_contents, |x| (x as i16).to_le_bytes())
        }
        DataType::Int32 => le(&c.int_contents, i32::to_le_bytes),
        DataType::Int64 => le(&c.int64_contents, i64::to_le_bytes),
        DataType::Fp32 => le(&c.fp32_contents, f32::to_le_bytes),
        DataType::Fp64 => le(&c.fp64_contents, f64::to_le_bytes),
        DataType::Fp16 | DataType::Bf16 => {
            return Err(format!(
                "{datatype} has no typed contents; send it in raw_input_contents"
            ))
        }
        DataType::Bytes => {
            kserve::encode_bytes_elements(c.bytes_contents.iter().map(|b| b.as_ref()))
        }
    };
    Ok(raw.into())
}

/// The response: tensor metadata in `outputs`, data in `raw_output_contents` (as Triton
/// answers).
pub fn infer_response(r: kserve::InferResponse) -> pb::ModelInferResponse {
    let mut raw = Vec::with_capacity(r.outputs.len());
    let outputs = r
        .outputs
        .into_iter()
        .map(|o| {
            raw.push(Bytes::from(o.data));
            pb::model_infer_response::InferOutputTensor {
                name: o.name,
                datatype: o.datatype.as_str().to_string(),
                shape: o.shape,
                parameters: HashMap::new(),
                contents: None,
            }
        })
        .collect();
    pb::ModelInferResponse {
        model_name: r.model,
        model_version: r.version,
        id: r.id,
        parameters: HashMap::new(),
        outputs,
        raw_output_contents: raw,
    }
}

pub fn model_metadata(m: kserve::ModelMetadata) -> pb::ModelMetadataResponse {
    let tensors = |ts: Vec<kserve::TensorMetadata>| {
        ts.into_iter()
            .map(|t| pb::model_metadata_response::TensorMetadata {
                name: t.name,
                datatype: t.datatype,
                shape: t.shape,
            })
            .collect()
    };
    pb::ModelMetadataResponse {
        name: m.name,
        versions: m.versions,
        platform: m.platform,
        inputs: tensors(m.inputs),
        outputs: tensors(m.outputs),
    }
}

fn duration(d: kserve::DurationStat) -> Option<pb::StatisticDuration> {
    Some(pb::StatisticDuration {
        count: d.count,
        ns: d.ns,
    })
}

pub fn model_statistics(s: kserve::ModelStatistics) -> pb::ModelStatistics {
    let i = s.inference_stats;
    pb::ModelStatistics {
        name: s.name,
        version: s.version,
        last_inference: s.last_inference,
        inference_count: s.inference_count,
        execution_count: s.execution_count,
        inference_stats: Some(pb::InferStatistics {
            success: duration(i.success),
            fail: duration(i.fail),
            queue: duration(i.queue),
            compute_input: duration(i.compute_input),
            compute_infer: duration(i.compute_infer),
            compute_output: duration(i.compute_output),
            cache_hit: duration(i.cache_hit),
            cache_miss: duration(i.cache_miss),
        }),
        batch_stats: Vec::new(),
        memory_usage: Vec::new(),
        response_stats: HashMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(
        name: &str,
        datatype: &str,
        shape: Vec<i64>,
    ) -> pb::model_infer_request::InferInputTensor {
        pb::model_infer_request::InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            parameters: HashMap::new(),
            contents: None,
        }
    }

    #[test]
    fn typed_contents_become_raw_and_out_of_range_values_are_refused() {
        let c = pb::InferTensorContents {
            uint_contents: vec![1, 255],
            ..Default::default()
        };
        assert_eq!(
            contents_to_raw(c, DataType::Uint8).unwrap().as_ref(),
            &[1, 255]
        );
        let c = pb::InferTensorContents {
            uint_contents: vec![256],
            ..Default::default()
        };
        assert!(contents_to_raw(c, DataType::Uint8)
            .unwrap_err()
            .contains("256"));
        let c = pb::InferTensorContents {
            fp32_contents: vec![0.5],
            ..Default::default()
        };
        assert_eq!(
            contents_to_raw(c, DataType::Fp32).unwrap().as_ref(),
            &0.5f32.to_le_bytes()
        );
    }

    #[test]
    fn raw_contents_pair_with_inputs_in_order_and_parameters_are_read() {
        let mut params = HashMap::new();
        params.insert(
            "timeout".to_string(),
            pb::InferParameter {
                parameter_choice: Some(pb::infer_parameter::ParameterChoice::Int64Param(1500)),
            },
        );
        let req = pb::ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![input("a", "UINT8", vec![2]), input("b", "UINT8", vec![1])],
            raw_input_contents: vec![Bytes::from_static(&[1, 2]), Bytes::from_static(&[3])],
            parameters: params,
            ..Default::default()
        };
        let r = infer_request(req).unwrap();
        assert_eq!(r.inputs[1].data.as_ref(), &[3]);
        assert_eq!(
            r.options.timeout,
            Some(std::time::Duration::from_micros(1500))
        );

        let req = pb::ModelInferRequest {
            inputs: vec![input("a", "UINT8", vec![2]), input("b", "UINT8", vec![1])],
            raw_input_contents: vec![Bytes::from_static(&[1, 2])],
            ..Default::default()
        };
        let e = tonic::Status::from(infer_request(req).unwrap_err());
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains("1 entries for 2 inputs"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn raw_contents_skip_inputs_in_shared_memory() {
        use pb::infer_parameter::ParameterChoice as P;
        let param = |p| pb::InferParameter {
            parameter_choice: Some(p),
        };
        let mut in_shm = input("a", "FP32", vec![2]);
        in_shm.parameters = HashMap::from([
            (
                "shared_memory_region".to_string(),
                param(P::StringParam("r".into())),
            ),
            (
                "shared_memory_byte_size".to_string(),
                param(P::Int64Param(8)),
            ),
            ("shared_memory_offset".to_string(), param(P::Int64Param(16))),
        ]);
        let mut out = pb::model_infer_request::InferRequestedOutputTensor {
            name: "o".into(),
            parameters: HashMap::new(),
        };
        out.parameters = in_shm.parameters.clone();
        let req = pb::ModelInferRequest {
            inputs: vec![in_shm.clone(), input("b", "UINT8", vec![1])],
            outputs: vec![out],
            raw_input_contents: vec![Bytes::from_static(&[3])],
            ..Default::default()
        };
        let r = infer_request(req).unwrap();
        let place = crate::shm::ShmRef {
            region: "r".into(),
            offset: 16,
            byte_size: 8,
        };
        assert_eq!(r.inputs[0].shared_memory, Some(place.clone()));
        assert!(r.inputs[0].data.is_empty());
        assert_eq!(r.inputs[1].data.as_ref(), &[3]);
        assert_eq!(r.outputs[0].shared_memory, Some(place));

        // A region and contents for one input; a region named by a number.
        let mut both = in_shm.clone();
        both.contents = Some(pb::InferTensorContents {
            fp32_contents: vec![1.0, 2.0],
            ..Default::default()
        });
        let mut bad = in_shm;
        bad.parameters
            .insert("shared_memory_region".into(), param(P::Int64Param(1)));
        for (inputs, says) in [
            (vec![both], "contents and is in shared memory"),
            (vec![bad], "must be a string"),
        ] {
            let req = pb::ModelInferRequest {
                inputs,
                ..Default::default()
            };
            let e = infer_request(req).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}
