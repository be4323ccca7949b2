//! CUDA shared memory over both transports, with GPU memory kept in host memory (the fake
//! engine's `FakeCudaIpc`): a client registers regions by CUDA IPC handle, the ensemble
//! reads its images from one and writes its scores into another at an offset, and the
//! scores are those of the same request sent inline; status lists each region with its
//! device, a read past a region is refused naming it, and unregistering lets the name go.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use common::{padded, photo, TestGateway};
use visiongate::grpc::pb;
use visiongate::grpc::pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use visiongate::settings::Config;
use visiongate::shm::FakeCudaIpc;
use visiongate::{EngineChoice, Gateway};

fn string(s: &str) -> pb::InferParameter {
    pb::InferParameter {
        parameter_choice: Some(pb::infer_parameter::ParameterChoice::StringParam(s.into())),
    }
}

fn int(n: usize) -> pb::InferParameter {
    pb::InferParameter {
        parameter_choice: Some(pb::infer_parameter::ParameterChoice::Int64Param(n as i64)),
    }
}

#[tokio::test]
async fn cuda_regions_carry_the_ensembles_images_and_scores() {
    let gpus = Arc::new(FakeCudaIpc::new(2));
    let mut config = Config::for_tests();
    config.server.allow_client_shm = true;
    let engine = EngineChoice::Fake {
        num_classes: 1000,
        latency: Duration::from_millis(1),
        faults: Arc::default(),
    };
    let settings = config.validate().unwrap();
    let gateway = Gateway::start_with_gpu_memory(settings, engine, gpus.clone())
        .await
        .unwrap();
    let gw = TestGateway::started(gateway).await;
    let images: Vec<Vec<u8>> = ["sk_chelsea.jpg", "sk_coffee.jpg", "sk_astronaut.jpg"]
        .iter()
        .map(|n| photo("small", n).1)
        .collect();
    let (status, inline) = gw.ensemble_infer(&images).await;
    assert_eq!(status, 200, "{inline}");
    let expected: Vec<f32> = inline["outputs"][0]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(expected.len(), images.len() * 1000);

    let (len, data) = padded(&images);
    let (in_handle, in_memory) = gpus.share(1, data.len());
    in_memory.lock().unwrap().copy_from_slice(&data);
    let scores = expected.len() * 4;
    let (out_handle, out_memory) = gpus.share(1, 64 + scores);
    let b64 = |h: &[u8]| base64::engine::general_purpose::STANDARD.encode(h);
    for (name, handle, size) in [
        ("in", &in_handle, data.len()),
        ("out", &out_handle, 64 + scores),
    ] {
        let body = serde_json::json!({"raw_handle": {"b64": b64(handle)}, "device_id": 1, "byte_size": size});
        let url = gw.url(&format!("/v2/cudasharedmemory/region/{name}/register"));
        let resp = gw.client.post(url).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    }
    let listed = gw
        .json(gw.client.get(gw.url("/v2/cudasharedmemory/status")))
        .await;
    assert_eq!(
        listed,
        serde_json::json!([
            {"name": "in", "device_id": 1, "byte_size": data.len()},
            {"name": "out", "device_id": 1, "byte_size": 64 + scores},
        ])
    );
    let read_back = |memory: &std::sync::Mutex<Vec<u8>>| -> Vec<f32> {
        let memory = memory.lock().unwrap();
        memory[64..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };

    // HTTP.
    let body = serde_json::json!({
        "inputs": [{"name": "RAW_IMAGE", "datatype": "UINT8", "shape": [images.len(), len],
                    "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": data.len()}}],
        "outputs": [{"name": "output__0",
                     "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": scores,
                                    "shared_memory_offset": 64}}],
    });
    let url = gw.url("/v2/models/ensemble_model/infer");
    let answer = gw.json(gw.client.post(&url).json(&body)).await;
    let output = &answer["outputs"][0];
    assert!(output.get("data").is_none(), "{answer}");
    assert_eq!(output["shape"], serde_json::json!([images.len(), 1000]));
    assert_eq!(read_back(&out_memory), expected);

    // gRPC.
    out_memory.lock().unwrap().fill(0);
    let addr = gw.gateway.as_ref().unwrap().grpc_addr.expect("listening");
    let mut grpc = GrpcInferenceServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let status = grpc
        .cuda_shared_memory_status(pb::CudaSharedMemoryStatusRequest { name: "out".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.regions["out"].device_id, 1);
    let request = |offset: usize| pb::ModelInferRequest {
        model_name: "ensemble_model".into(),
        inputs: vec![pb::model_infer_request::InferInputTensor {
            name: "RAW_IMAGE".into(),
            datatype: "UINT8".into(),
            shape: vec![images.len() as i64, len as i64],
            parameters: [
                ("shared_memory_region".to_string(), string("in")),
                ("shared_memory_byte_size".to_string(), int(data.len())),
                ("shared_memory_offset".to_string(), int(offset)),
            ]
            .into(),
            ..Default::default()
        }],
        outputs: vec![pb::model_infer_request::InferRequestedOutputTensor {
            name: "output__0".into(),
            parameters: [
                ("shared_memory_region".to_string(), string("out")),
                ("shared_memory_byte_size".to_string(), int(scores)),
                ("shared_memory_offset".to_string(), int(64)),
            ]
            .into(),
        }],
        ..Default::default()
    };
    grpc.model_infer(request(0)).await.unwrap();
    assert_eq!(read_back(&out_memory), expected);
    let e = grpc.model_infer(request(1)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("shared memory region 'in'"),
        "{}",
        e.message()
    );

    // A handle registered again under another name, on the GPU it is not on, is refused by
    // the driver; the names go when unregistered.
    let e = grpc
        .cuda_shared_memory_register(pb::CudaSharedMemoryRegisterRequest {
            name: "again".into(),
            raw_handle: in_handle.to_vec().into(),
            device_id: 0,
            byte_size: 8,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("on GPU 0"), "{}", e.message());
    grpc.cuda_shared_memory_unregister(pb::CudaSharedMemoryUnregisterRequest {
        name: String::new(),
    })
    .await
    .unwrap();
    let listed = gw
        .json(gw.client.get(gw.url("/v2/cudasharedmemory/status")))
        .await;
    assert_eq!(listed, serde_json::json!([]));
    gw.stop().await;
}
