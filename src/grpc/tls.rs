//! gRPC over TLS (Triton's `--grpc-use-ssl` and `--grpc-use-ssl-mutual`): the server's
//! certificate and key from PEM files, and for mutual TLS the roots that sign clients'
//! certificates. HTTP/2 is offered by ALPN, as gRPC clients require.
use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls::crypto::aws_lc_rs;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

pub use tokio_rustls::TlsAcceptor;

/// The TLS settings of the gRPC listener. `client_roots`: mutual TLS, where a client must
/// present a certificate one of these signed. Each error names the argument and file.
pub fn acceptor(
    cert: &Path,
    key: &Path,
    client_roots: Option<&Path>,
) -> Result<TlsAcceptor, String> {
    let read_certs = |flag: &str, path: &Path| -> Result<Vec<CertificateDer<'static>>, String> {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("{flag} {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "{flag} {}: no PEM certificate in it",
                path.display()
            ));
        }
        Ok(certs)
    };
    let chain = read_certs("--grpc-server-cert", cert)?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("--grpc-server-key {}: {e}", key.display()))?;
    let provider = Arc::new(aws_lc_rs::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_roots {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for c in read_certs("--grpc-root-cert", path)? {
                roots
                    .add(c)
                    .map_err(|e| format!("--grpc-root-cert {}: {e}", path.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("--grpc-root-cert {}: {e}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        format!(
            "--grpc-server-cert {} and --grpc-server-key: {e}",
            cert.display()
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
