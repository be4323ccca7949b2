//! Tensors in system shared memory (Triton's extension; a tensor's `shared_memory_*`
//! parameters are read in `params.rs`): inputs are read from their region before
//! inference, outputs written to theirs after it (their places checked before the model
//! runs).
use super::tensor::element_count;
use super::{InputTensor, OutputTensor, RequestedOutput};
use crate::error::{ErrorKind, GatewayError};
use crate::shm::Place;
use crate::state::AppState;

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
    let inline = at.byte_size < 1 << 20 && !place.on_gpu();
    input.data = blocking(inline, move || place.read(&name, limit)).await??;
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
        let inline = data.len() < 1 << 20 && !place.on_gpu();
        blocking(inline, move || place.write(&name, &data)).await??;
    }
    Ok(())
}

/// Runs a region's I/O: `inline` (a small file read or write) here, the rest (a copy of many
/// megabytes, or any copy from or to a GPU, which the driver may hold up) on Tokio's
/// blocking threads, where it holds up no connection of this worker.
async fn blocking<T: Send + 'static>(
    inline: bool,
    io: impl FnOnce() -> T + Send + 'static,
) -> Result<T, GatewayError> {
    if inline {
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
