//! Tensors in system shared memory (Triton's extension): a tensor's `shared_memory_region`,
//! `shared_memory_offset` and `shared_memory_byte_size` parameters, read the same way on
//! both transports; inputs are read from their region before inference, outputs written to
//! theirs after it (their places checked before the model runs).
use super::tensor::element_count;
use super::{InputTensor, OutputTensor, RequestedOutput};
use crate::error::{ErrorKind, GatewayError};
use crate::state::{AppState, Place, ShmRef};

/// One `shared_memory_*` parameter as a transport found it: absent, or present with a
/// value of the right type (`Some(Some(_))`) or of another type (`Some(None)`).
pub type Param<T> = Option<Option<T>>;

/// The place of tensor `tensor` from its parameters; `None` when it has no region. The
/// offset defaults to 0; the byte size is required with a region, and neither number goes
/// without one.
pub fn shared_memory_ref(
    tensor: &str,
    region: Param<String>,
    offset: Param<u64>,
    byte_size: Param<u64>,
) -> Result<Option<ShmRef>, GatewayError> {
    let number = |name: &str, value: Param<u64>| -> Result<Option<u64>, GatewayError> {
        match value {
            None => Ok(None),
            Some(None) => Err(GatewayError::invalid(format!(
                "tensor '{tensor}': '{name}' must be a non-negative integer"
            ))),
            Some(Some(v)) => Ok(Some(v)),
        }
    };
    let offset = number("shared_memory_offset", offset)?;
    let byte_size = number("shared_memory_byte_size", byte_size)?;
    let region = match region {
        None => {
            if offset.is_some() || byte_size.is_some() {
                return Err(GatewayError::invalid(format!(
                    "tensor '{tensor}': 'shared_memory_offset' and 'shared_memory_byte_size' \
                     can not be specified without 'shared_memory_region'"
                )));
            }
            return Ok(None);
        }
        Some(None) => {
            return Err(GatewayError::invalid(format!(
                "tensor '{tensor}': 'shared_memory_region' must be a string (a registered \
                 region's name)"
            )))
        }
        Some(Some(region)) => region,
    };
    let byte_size = byte_size.ok_or_else(|| {
        GatewayError::invalid(format!(
            "tensor '{tensor}': 'shared_memory_region' needs 'shared_memory_byte_size'"
        ))
    })?;
    Ok(Some(ShmRef {
        region,
        offset: offset.unwrap_or(0),
        byte_size,
    }))
}

/// The place of each output asked in shared memory, checked before the model runs and
/// held until its data is written (an unregister meanwhile closes nothing under it).
pub fn output_places(
    state: &AppState,
    wanted: &[RequestedOutput],
) -> Result<Vec<Option<Place>>, GatewayError> {
    wanted
        .iter()
        .map(|o| {
            let Some(at) = &o.shared_memory else {
                return Ok(None);
            };
            if o.classification.is_some() {
                return Err(GatewayError::invalid(format!(
                    "output '{}' can't set both 'shared_memory_region' and 'classification'",
                    o.name
                )));
            }
            Ok(Some(state.shared_memory.place(at)?))
        })
        .collect()
}

/// Reads `input` of model `model` from shared memory when it is there. Its size is checked
/// first: against its shape (fixed-size datatypes) and `--max-body-bytes` (as for a body).
pub async fn read_input(
    state: &AppState,
    input: &mut InputTensor,
    model: &str,
) -> Result<(), GatewayError> {
    let Some(at) = &input.shared_memory else {
        return Ok(());
    };
    if let Some(size) = input.datatype.size() {
        let wanted = element_count(&input.shape)
            .ok()
            .and_then(|n| n.checked_mul(size))
            .map(|n| n as u64);
        if wanted != Some(at.byte_size) {
            return Err(GatewayError::invalid(format!(
                "input '{}' of model '{model}': shared_memory_byte_size is {}, but shape {:?} \
                 of {} needs {}",
                input.name,
                at.byte_size,
                input.shape,
                input.datatype,
                wanted.map_or("more than this server can address".to_string(), |n| n
                    .to_string()),
            )));
        }
    }
    let place = state.shared_memory.place(at)?;
    let (name, limit) = (input.name.clone(), state.limits.max_body_bytes);
    input.data = blocking(at.byte_size, move || place.read(&name, limit)).await??;
    Ok(())
}

/// Writes each output asked in shared memory to its place (from [`output_places`]); it
/// keeps its datatype and shape, and no data.
pub async fn write_outputs(
    places: Vec<Option<Place>>,
    outputs: &mut [OutputTensor],
) -> Result<(), GatewayError> {
    for (place, out) in places.into_iter().zip(outputs) {
        let Some(place) = place else {
            continue;
        };
        out.shared_memory = Some(place.at().clone());
        let (name, data) = (out.name.clone(), std::mem::take(&mut out.data));
        blocking(data.len() as u64, move || place.write(&name, &data)).await??;
    }
    Ok(())
}

/// Runs file I/O of `bytes` bytes: small ones here, large ones on Tokio's blocking threads
/// (a copy of many megabytes would hold up every connection of this worker).
async fn blocking<T: Send + 'static>(
    bytes: u64,
    io: impl FnOnce() -> T + Send + 'static,
) -> Result<T, GatewayError> {
    if bytes < 1 << 20 {
        return Ok(io());
    }
    tokio::task::spawn_blocking(io)
        .await
        .map_err(|e| match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            // The runtime is shutting down.
            Err(_) => GatewayError::new(ErrorKind::ShuttingDown, "the server is stopping"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_become_a_place_or_a_named_error() {
        let r = |region: Param<&str>, offset, size| {
            shared_memory_ref("t", region.map(|r| r.map(String::from)), offset, size)
        };
        assert_eq!(r(None, None, None).unwrap(), None);
        assert_eq!(
            r(Some(Some("a")), None, Some(Some(8))).unwrap(),
            Some(ShmRef {
                region: "a".into(),
                offset: 0,
                byte_size: 8
            })
        );
        let message = |e: GatewayError| e.to_string();
        assert!(message(r(None, Some(Some(1)), None).unwrap_err()).contains("without"));
        assert!(message(r(Some(Some("a")), None, None).unwrap_err()).contains("byte_size"));
        assert!(message(r(Some(None), None, Some(Some(1))).unwrap_err()).contains("string"));
        assert!(
            message(r(Some(Some("a")), Some(None), Some(Some(1))).unwrap_err())
                .contains("'shared_memory_offset' must be a non-negative integer")
        );
    }
}
