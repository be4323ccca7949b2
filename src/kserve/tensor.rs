//! Tensors as the protocol carries them: a datatype name, a shape and the elements in raw
//! form (row-major, little-endian, no padding; each BYTES element has a 4-byte
//! little-endian length prefix). JSON and typed gRPC contents are converted to this form at
//! the transport, so inference sees one layout.
use bytes::Bytes;

use crate::repository::pb;

/// The protocol's tensor element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Bf16,
    Fp32,
    Fp64,
    Bytes,
}

impl DataType {
    const ALL: [DataType; 14] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Bf16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Bf16 => "BF16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }

    /// Parses a protocol datatype name ("FP32", "BYTES", ...).
    pub fn parse(name: &str) -> Result<DataType, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|t| t.as_str()).collect();
                format!("unknown datatype '{name}' (one of {})", names.join(", "))
            })
    }

    /// The datatype of a config's `TYPE_X` (`TYPE_STRING` is BYTES).
    pub fn from_config(t: pb::DataType) -> Option<DataType> {
        Some(match t {
            pb::DataType::TypeBool => DataType::Bool,
            pb::DataType::TypeUint8 => DataType::Uint8,
            pb::DataType::TypeUint16 => DataType::Uint16,
            pb::DataType::TypeUint32 => DataType::Uint32,
            pb::DataType::TypeUint64 => DataType::Uint64,
            pb::DataType::TypeInt8 => DataType::Int8,
            pb::DataType::TypeInt16 => DataType::Int16,
            pb::DataType::TypeInt32 => DataType::Int32,
            pb::DataType::TypeInt64 => DataType::Int64,
            pb::DataType::TypeFp16 => DataType::Fp16,
            pb::DataType::TypeBf16 => DataType::Bf16,
            pb::DataType::TypeFp32 => DataType::Fp32,
            pb::DataType::TypeFp64 => DataType::Fp64,
            pb::DataType::TypeString => DataType::Bytes,
            pb::DataType::TypeInvalid => return None,
        })
    }

    /// Bytes per element; `None` for BYTES (variable).
    pub fn size(self) -> Option<usize> {
        Some(match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => 1,
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 | DataType::Bf16 => 2,
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => 4,
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => 8,
            DataType::Bytes => return None,
        })
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One input tensor of a request, its data in raw form.
#[derive(Debug, Clone)]
pub struct InputTensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
    pub data: Bytes,
    /// Where the data is when it is in system shared memory (`data` is empty until
    /// inference reads it).
    pub shared_memory: Option<crate::shm::ShmRef>,
}

/// Elements of a shape; an error names a negative dimension or an overflow.
pub fn element_count(shape: &[i64]) -> Result<usize, String> {
    shape.iter().try_fold(1usize, |n, &d| {
        let d = usize::try_from(d).map_err(|_| format!("negative dimension {d} in shape"))?;
        n.checked_mul(d)
            .ok_or_else(|| "shape has too many elements".to_string())
    })
}

impl InputTensor {
    /// Checks that the data holds exactly the elements the shape asks for.
    pub fn check_size(&self) -> Result<(), String> {
        let n = element_count(&self.shape)?;
        match self.datatype.size() {
            Some(size) => {
                let want = n.checked_mul(size).ok_or("shape has too many elements")?;
                if self.data.len() != want {
                    return Err(format!(
                        "has {} bytes of data, but shape {:?} of {} needs {want}",
                        self.data.len(),
                        self.shape,
                        self.datatype
                    ));
                }
            }
            None => {
                let got = count_bytes_elements(&self.data)?;
                if got != n {
                    return Err(format!(
                        "has {got} BYTES elements, but shape {:?} needs {n}",
                        self.shape
                    ));
                }
            }
        }
        Ok(())
    }
}

/// How many elements raw BYTES data holds (each a 4-byte little-endian length, then the
/// bytes); an error says where it is cut short. Counts without building anything.
pub fn count_bytes_elements(mut data: &[u8]) -> Result<usize, String> {
    let mut n = 0;
    while !data.is_empty() {
        let Some((len, rest)) = data.split_first_chunk::<4>() else {
            return Err("BYTES data ends inside an element's 4-byte length".into());
        };
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(format!(
                "BYTES element {n} claims {len} bytes but only {} remain",
                rest.len()
            ));
        }
        data = &rest[len..];
        n += 1;
    }
    Ok(n)
}

/// The elements of raw BYTES data, one at a time; it ends early where the data is cut
/// short, so check it with [`count_bytes_elements`] first.
pub fn bytes_elements(mut data: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        let (len, rest) = data.split_first_chunk::<4>()?;
        let len = u32::from_le_bytes(*len) as usize;
        let element = rest.get(..len)?;
        data = &rest[len..];
        Some(element)
    })
}

/// Raw BYTES data for `elements`.
pub fn encode_bytes_elements<'a>(elements: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for e in elements {
        out.extend_from_slice(&(e.len() as u32).to_le_bytes());
        out.extend_from_slice(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datatype_names_round_trip_and_unknown_names_are_listed() {
        for t in DataType::ALL {
            assert_eq!(DataType::parse(t.as_str()), Ok(t));
        }
        let e = DataType::parse("FLOAT").unwrap_err();
        assert!(e.contains("FLOAT") && e.contains("FP32"), "{e}");
    }

    #[test]
    fn bytes_elements_round_trip_and_truncation_is_an_error() {
        let raw = encode_bytes_elements([&b"ab"[..], b"", b"xyz"]);
        assert_eq!(raw.len(), 4 + 2 + 4 + 4 + 3);
        assert_eq!(count_bytes_elements(&raw), Ok(3));
        assert_eq!(
            bytes_elements(&raw).collect::<Vec<_>>(),
            vec![&b"ab"[..], b"", b"xyz"]
        );
        assert!(count_bytes_elements(&raw[..raw.len() - 1])
            .unwrap_err()
            .contains("claims 3 bytes"));
        assert!(count_bytes_elements(&raw[..2])
            .unwrap_err()
            .contains("4-byte length"));
    }

    #[test]
    fn size_checks_count_elements_of_the_shape() {
        let t = |datatype, shape: Vec<i64>, data: Vec<u8>| InputTensor {
            name: "x".into(),
            datatype,
            shape,
            data: data.into(),
            shared_memory: None,
        };
        assert!(t(DataType::Fp32, vec![2, 3], vec![0; 24])
            .check_size()
            .is_ok());
        let e = t(DataType::Fp32, vec![2, 3], vec![0; 20])
            .check_size()
            .unwrap_err();
        assert!(e.contains("20 bytes") && e.contains("needs 24"), "{e}");
        assert!(t(DataType::Uint8, vec![-1, 3], vec![])
            .check_size()
            .unwrap_err()
            .contains("negative"));
        let two = encode_bytes_elements([&b"a"[..], b"b"]);
        assert!(t(DataType::Bytes, vec![2], two.clone())
            .check_size()
            .is_ok());
        assert!(t(DataType::Bytes, vec![3], two)
            .check_size()
            .unwrap_err()
            .contains("needs 3"));
    }
}
