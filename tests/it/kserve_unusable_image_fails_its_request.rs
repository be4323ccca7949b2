//! KServe has no per-row errors: an image of an ensemble request that cannot be used fails
//! the whole request, naming its row, with the status of why: 413 / RESOURCE_EXHAUSTED for
//! an image over `--max-image-pixels`, 400 / INVALID_ARGUMENT for one that is not an image.
use crate::common;

use std::time::Duration;

use common::{padded, TestGateway};
use visiongate::grpc::pb;
use visiongate::grpc::pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use visiongate::settings::Config;

fn png(side: u32) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(side, side, image::Rgb([7, 100, 50]));
    let mut out = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut out, image::ImageFormat::Png)
        .unwrap();
    out.into_inner()
}

async fn grpc_infer(gw: &TestGateway, images: &[Vec<u8>]) -> tonic::Status {
    let addr = gw.gateway.as_ref().unwrap().grpc_addr.expect("listening");
    let mut grpc = GrpcInferenceServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (len, data) = padded(images);
    let request = pb::ModelInferRequest {
        model_name: "ensemble_model".into(),
        inputs: vec![pb::model_infer_request::InferInputTensor {
            name: "RAW_IMAGE".into(),
            datatype: "UINT8".into(),
            shape: vec![images.len() as i64, len as i64],
            ..Default::default()
        }],
        raw_input_contents: vec![data.into()],
        ..Default::default()
    };
    grpc.model_infer(request)
        .await
        .expect_err("an unusable row fails the request")
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unusable_image_fails_its_request_naming_the_row() {
    let mut config = Config::for_tests();
    // 8x8 images pass, 32x32 ones are over the limit.
    config.decode.max_image_pixels = 100;
    let gw = TestGateway::start_fake(config, Duration::ZERO).await;

    let (status, body) = gw.ensemble_infer(&[png(8), png(32)]).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["code"], "payload_too_large", "{body}");
    let message = body["error"].as_str().unwrap();
    assert!(
        message.contains("row 1") && message.contains("above the limit of 100"),
        "{message}"
    );
    let status = grpc_infer(&gw, &[png(8), png(32)]).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("row 1"), "{status:?}");

    let not_an_image = b"this is not an image".to_vec();
    let (status, body) = gw.ensemble_infer(&[not_an_image.clone(), png(8)]).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "invalid_input", "{body}");
    assert!(body["error"].as_str().unwrap().contains("row 0"), "{body}");
    let status = grpc_infer(&gw, &[not_an_image, png(8)]).await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");

    // Counted as ended by its own input (OTHER), not as a model failure.
    assert_eq!(
        gw.metric("nv_inference_request_failure", &["classifier", "OTHER"])
            .await,
        4.0
    );
    assert_eq!(
        gw.metric("nv_inference_request_failure", &["classifier", "BACKEND"])
            .await,
        0.0
    );
    gw.stop().await;
}
