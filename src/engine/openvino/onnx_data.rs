//! Whether an ONNX file keeps any tensor's data outside itself. OpenVINO's ONNX reader
//! resolves an external-data location against the model's directory without keeping it
//! there (and reads a location of its own in-memory form as an address), so an ONNX model
//! that names external data is refused before OpenVINO reads it. The file is walked in
//! protobuf's wire format along the fields that can hold a tensor (field numbers from
//! onnx.proto); everything else, raw tensor bytes included, is skipped unread.

/// Where a tensor with external data sits, or why the file is not an ONNX model.
#[derive(Debug, PartialEq, Eq)]
pub enum Finding {
    ExternalData(&'static str),
    Malformed(&'static str),
}

/// The message types on the way to a tensor, with their fields that lead further.
#[derive(Clone, Copy)]
enum Kind {
    Model,
    Graph,
    Node,
    Attribute,
    Function,
    Tensor,
    SparseTensor,
}

impl Kind {
    /// What field `number` of this message holds, if it can lead to a tensor.
    fn field(self, number: u64) -> Option<Kind> {
        use Kind::*;
        match (self, number) {
            (Model, 7) => Some(Graph),                  // graph
            (Model, 25) => Some(Function),              // functions
            (Graph, 1) => Some(Node),                   // node
            (Graph, 5) => Some(Tensor),                 // initializer
            (Graph, 15) => Some(SparseTensor),          // sparse_initializer
            (Node, 5) => Some(Attribute),               // attribute
            (Function, 7) => Some(Node),                // node
            (Attribute, 5 | 10) => Some(Tensor),        // t, tensors
            (Attribute, 6 | 11) => Some(Graph),         // g, graphs
            (Attribute, 22 | 23) => Some(SparseTensor), // sparse_tensor(s)
            (SparseTensor, 1 | 2) => Some(Tensor),      // values, indices
            _ => None,
        }
    }
}

/// How deep subgraphs may nest before the file is refused (a hostile file could nest
/// them until the walk ran out of stack).
const MAX_DEPTH: usize = 64;

/// `Ok(())` when no tensor of the ONNX model `bytes` names external data.
pub fn check(bytes: &[u8]) -> Result<(), Finding> {
    walk(bytes, Kind::Model, 0)
}

fn walk(mut bytes: &[u8], kind: Kind, depth: usize) -> Result<(), Finding> {
    if depth > MAX_DEPTH {
        return Err(Finding::Malformed("subgraphs nested too deep"));
    }
    while !bytes.is_empty() {
        let key = varint(&mut bytes)?;
        let (number, wire) = (key >> 3, key & 7);
        match wire {
            0 => {
                let value = varint(&mut bytes)?;
                // TensorProto.data_location = EXTERNAL.
                if matches!(kind, Kind::Tensor) && number == 14 && value == 1 {
                    return Err(Finding::ExternalData(
                        "a tensor's data_location is EXTERNAL",
                    ));
                }
            }
            1 => bytes = skip(bytes, 8)?,
            5 => bytes = skip(bytes, 4)?,
            2 => {
                let len = usize::try_from(varint(&mut bytes)?)
                    .map_err(|_| Finding::Malformed("a length past the file"))?;
                if len > bytes.len() {
                    return Err(Finding::Malformed("a length past the file"));
                }
                let (inner, rest) = bytes.split_at(len);
                bytes = rest;
                // TensorProto.external_data.
                if matches!(kind, Kind::Tensor) && number == 13 {
                    return Err(Finding::ExternalData("a tensor names external_data"));
                }
                if let Some(next) = kind.field(number) {
                    walk(inner, next, depth + 1)?;
                }
            }
            _ => return Err(Finding::Malformed("an unknown wire type")),
        }
    }
    Ok(())
}

fn skip(bytes: &[u8], n: usize) -> Result<&[u8], Finding> {
    bytes
        .get(n..)
        .ok_or(Finding::Malformed("a field past the file"))
}

fn varint(bytes: &mut &[u8]) -> Result<u64, Finding> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = bytes
            .split_first()
            .ok_or(Finding::Malformed("a number past the file"))?;
        *bytes = rest;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(Finding::Malformed("a number longer than 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(mut n: u64, out: &mut Vec<u8>) {
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    /// A length-delimited field.
    fn field(number: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(number << 3 | 2, &mut out);
        encode(payload.len() as u64, &mut out);
        out.extend_from_slice(payload);
        out
    }

    fn varint_field(number: u64, value: u8) -> Vec<u8> {
        vec![(number << 3) as u8, value]
    }

    #[test]
    fn external_data_is_found_wherever_a_tensor_can_be() {
        // A tensor with raw data (field 9) and a name (field 8): fine.
        let plain_tensor = [field(8, b"w"), field(9, &[1, 2, 3, 4])].concat();
        let graph = field(5, &plain_tensor);
        let model = [varint_field(1, 8), field(7, &graph)].concat();
        assert_eq!(check(&model), Ok(()));

        // An initializer naming external data.
        let entry = [field(1, b"location"), field(2, b"../../x")].concat();
        let external = [field(8, b"w"), field(13, &entry), varint_field(14, 1)].concat();
        let model = field(7, &field(5, &external));
        assert_eq!(
            check(&model),
            Err(Finding::ExternalData("a tensor names external_data"))
        );
        // data_location alone.
        let model = field(7, &field(5, &varint_field(14, 1)));
        assert!(matches!(check(&model), Err(Finding::ExternalData(_))));

        // A Constant node's attribute tensor inside a subgraph of an If node.
        let attribute_tensor = field(5, &field(13, &entry));
        let inner_graph = field(1, &field(5, &attribute_tensor));
        let outer_node = field(5, &field(6, &inner_graph));
        let model = field(7, &field(1, &outer_node));
        assert!(matches!(check(&model), Err(Finding::ExternalData(_))));
        // A function's node.
        let model = field(25, &field(7, &field(5, &attribute_tensor)));
        assert!(matches!(check(&model), Err(Finding::ExternalData(_))));
        // A sparse initializer's values.
        let sparse = field(1, &field(13, &entry));
        let model = field(7, &field(15, &sparse));
        assert!(matches!(check(&model), Err(Finding::ExternalData(_))));

        // Bytes that look like external data inside raw data are not read.
        let raw = field(9, &field(13, &entry));
        assert_eq!(check(&field(7, &field(5, &raw))), Ok(()));
    }

    #[test]
    fn a_file_cut_short_or_nested_too_deep_is_malformed() {
        let model = field(7, &field(5, &field(8, b"w")));
        assert!(matches!(
            check(&model[..model.len() - 1]),
            Err(Finding::Malformed(_))
        ));
        assert!(matches!(check(&[0x80]), Err(Finding::Malformed(_))));
        // Subgraphs in subgraphs (attribute -> graph -> node -> attribute ...), deeper
        // than the walk goes.
        let mut attribute = Vec::new();
        for _ in 0..=MAX_DEPTH / 3 {
            attribute = field(6, &field(1, &field(5, &attribute)));
        }
        let model = field(7, &field(1, &field(5, &attribute)));
        assert_eq!(
            check(&model),
            Err(Finding::Malformed("subgraphs nested too deep"))
        );
    }
}
