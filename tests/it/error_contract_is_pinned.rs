//! The error contract clients depend on: every `code` with its HTTP status, gRPC code and
//! body shape, rendered from the one mapping in `error.rs` and compared with the snapshot
//! in `tests/fixtures/error_contract.txt`. A change here is a change users see: update the
//! snapshot only on purpose (the test prints what it rendered).
use actix_web::body::MessageBody;
use actix_web::ResponseError;
use visiongate::error::{ErrorKind, GatewayError};

const MESSAGE: &str = "what went wrong, and where";

fn render(kind: ErrorKind) -> String {
    let error = GatewayError::new(kind, MESSAGE);
    let response = error.error_response();
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map_or("-".to_string(), |v| v.to_str().unwrap().to_string());
    let bytes = response.into_body().try_into_bytes().unwrap();
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let mut keys: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort();
    assert_eq!(body["code"], kind.code(), "{kind:?}: body code");
    let message = if body["error"] == MESSAGE {
        "message"
    } else {
        assert!(
            !body["error"].as_str().unwrap().contains(MESSAGE),
            "{kind:?}: details leaked"
        );
        "hidden"
    };
    let grpc = tonic::Status::from(GatewayError::new(kind, MESSAGE));
    let grpc_message = if grpc.message() == MESSAGE {
        "message"
    } else {
        "hidden"
    };
    format!(
        "{:<24} {status:<4} {:<18} retry-after={retry_after:<2} body={{{}}} error={message} grpc-message={grpc_message}",
        kind.code(),
        format!("{:?}", grpc.code()),
        keys.join(","),
    )
}

#[test]
fn every_error_code_keeps_its_status_grpc_code_and_body() {
    let rendered: String = ErrorKind::ALL.iter().map(|&k| render(k) + "\n").collect();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/error_contract.txt"
    );
    let pinned = std::fs::read_to_string(path).unwrap_or_default();
    let pinned: String = pinned
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        rendered, pinned,
        "the error contract changed; if on purpose, put this in {path}:\n{rendered}"
    );
}
