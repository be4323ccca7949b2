//! `config.pbtxt` → `pb::ModelConfig` through a real protobuf text-format parser
//! (prost-reflect, against the descriptor of `proto/model_config.proto`).
use std::sync::LazyLock;

use prost_reflect::{DescriptorPool, DynamicMessage};

use super::{pb, RepositoryError};

static DESCRIPTORS: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(
        include_bytes!(concat!(env!("OUT_DIR"), "/model_config_descriptor.bin")).as_ref(),
    )
    .expect("the descriptor set built from proto/model_config.proto decodes")
});

fn model_config_descriptor() -> prost_reflect::MessageDescriptor {
    DESCRIPTORS
        .get_message_by_name("inference.ModelConfig")
        .expect("inference.ModelConfig is in the descriptor set")
}

/// Parses the text of a `config.pbtxt`. `model` only names the model in errors.
pub fn parse_model_config(model: &str, text: &str) -> Result<pb::ModelConfig, RepositoryError> {
    let desc = model_config_descriptor();
    let parse_err = |message: String| RepositoryError::Parse {
        model: model.to_string(),
        message,
    };
    let (normalized, inserted) = colon_before_message_lists(text);
    let dynamic = DynamicMessage::parse_text_format(desc, &normalized)
        .map_err(|e| parse_err(describe_parse_error(&e, text, &inserted)))?;
    dynamic
        .transcode_to::<pb::ModelConfig>()
        .map_err(|e| parse_err(e.to_string()))
}

/// Parses a `ModelConfig` given as JSON (the protobuf JSON mapping, proto or JSON field
/// names): what a load request's `config` parameter carries. `model` names the model in
/// errors.
pub fn parse_model_config_json(
    model: &str,
    json: &str,
) -> Result<pb::ModelConfig, RepositoryError> {
    let desc = model_config_descriptor();
    let parse_err = |message: String| RepositoryError::Parse {
        model: model.to_string(),
        message,
    };
    let mut de = serde_json::Deserializer::from_str(json);
    let dynamic = DynamicMessage::deserialize(desc, &mut de).map_err(|e| {
        parse_err(format!(
            "the load request's config is not a ModelConfig: {e}"
        ))
    })?;
    de.end()
        .map_err(|e| parse_err(format!("the load request's config: {e}")))?;
    dynamic
        .transcode_to::<pb::ModelConfig>()
        .map_err(|e| parse_err(e.to_string()))
}

/// `config` as Triton's `/config` endpoints return it: the protobuf JSON mapping with the
/// proto field names, enums by name, 64-bit integers as strings and every field present.
pub fn model_config_json(config: &pb::ModelConfig) -> serde_json::Value {
    let desc = model_config_descriptor();
    let mut dynamic = DynamicMessage::new(desc);
    dynamic
        .transcode_from(config)
        .expect("pb::ModelConfig is generated from the same descriptor");
    let options = prost_reflect::SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(false);
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .expect("a protobuf message always maps to JSON")
}

/// The text format lets a message field omit its colon, lists included (`input [ {..} ]`,
/// as every Triton example writes it), but prost-reflect requires one before `[`. Insert
/// it: after a field name (an identifier that is not a value, i.e. not right after `:`)
/// that is followed by `[`. Strings and comments are skipped. Returns the new text and the
/// offsets (in the new text) of the inserted colons, to map error positions back.
fn colon_before_message_lists(text: &str) -> (String, Vec<usize>) {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 16);
    let mut inserted = Vec::new();
    let mut i = 0;
    // Whether the last token was a field name (an identifier not preceded by ':').
    let mut after_field_name = false;
    let mut prev_was_colon = false;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'#' => {
                let end = text[i..].find('\n').map_or(bytes.len(), |n| i + n);
                out.push_str(&text[i..end]);
                i = end;
            }
            b'"' | b'\'' => {
                let mut j = i + 1;
                while j < bytes.len() && bytes[j] != c {
                    j += if bytes[j] == b'\\' { 2 } else { 1 };
                }
                let end = (j + 1).min(bytes.len());
                out.push_str(&text[i..end]);
                i = end;
                after_field_name = false;
                prev_was_colon = false;
            }
            c if c.is_ascii_whitespace() => {
                out.push(c as char);
                i += 1;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < bytes.len()
                    && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'.')
                {
                    i += 1;
                }
                out.push_str(&text[start..i]);
                after_field_name = !prev_was_colon;
                prev_was_colon = false;
            }
            b'[' if after_field_name => {
                inserted.push(out.len());
                out.push_str(": [");
                i += 1;
                after_field_name = false;
                prev_was_colon = false;
            }
            _ => {
                let ch = text[i..].chars().next().unwrap_or(' ');
                out.push(ch);
                prev_was_colon = c == b':';
                after_field_name = false;
                i += ch.len_utf8();
            }
        }
    }
    (out, inserted)
}

/// The parser's message plus the line and column it points at.
fn describe_parse_error(
    e: &prost_reflect::text_format::ParseError,
    text: &str,
    inserted: &[usize],
) -> String {
    use miette::Diagnostic;
    let offset = e
        .labels()
        .and_then(|mut l| l.next())
        .map(|l| l.offset() - inserted.iter().filter(|&&i| i < l.offset()).count());
    match offset {
        Some(offset) => {
            // The offset may fall inside a character (it counts bytes of the normalized text).
            let mut end = offset.min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let before = &text[..end];
            let line = before.matches('\n').count() + 1;
            let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("{} (line {line}, column {col})", shortened(&e.to_string()))
        }
        None => shortened(&e.to_string()),
    }
}

/// A parse error's message with each token it quotes from the file cut to 64 characters:
/// the message reaches API clients (the load answer, the repository index), and a file
/// that is not a config at all should not come back to them through it.
fn shortened(message: &str) -> String {
    const MOST: usize = 64;
    let mut out = String::with_capacity(message.len().min(1024));
    for (i, part) in message.split('\'').enumerate() {
        if i > 0 {
            out.push('\'');
        }
        if i % 2 == 1 && part.chars().count() > MOST {
            out.extend(part.chars().take(MOST));
            out.push_str("...");
        } else {
            out.push_str(part);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_is_not_a_config_does_not_come_back_in_its_error() {
        let secret = "A".repeat(200);
        let err = parse_model_config("m", &format!("{secret}: 1\n"))
            .unwrap_err()
            .to_string();
        assert!(
            !err.contains(&secret) && err.contains(&"A".repeat(64)),
            "{err}"
        );
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn parses_a_triton_config_with_nested_messages_and_maps() {
        let cfg = parse_model_config(
            "m",
            r#"
            name: "m"
            platform: "pytorch_libtorch"
            max_batch_size: 8
            input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
            output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" } ]
            instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]
            dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
            parameters { key: "a" value: { string_value: "b" } }
            version_policy: { latest { num_versions: 2 } }
            "#,
        )
        .unwrap();
        assert_eq!(cfg.max_batch_size, 8);
        assert_eq!(cfg.input[0].dims, vec![3, 224, 224]);
        assert_eq!(cfg.input[0].data_type(), pb::DataType::TypeFp32);
        assert_eq!(cfg.output[0].label_filename, "labels.txt");
        let g = &cfg.instance_group[0];
        assert_eq!(
            (g.count, g.kind(), g.gpus.clone()),
            (2, pb::model_instance_group::Kind::Gpu, vec![0, 1])
        );
        match cfg.scheduling_choice {
            Some(pb::model_config::SchedulingChoice::DynamicBatching(ref d)) => {
                assert_eq!(d.preferred_batch_size, vec![4, 8]);
                assert_eq!(d.max_queue_delay_microseconds, 100);
            }
            ref other => panic!("expected dynamic batching, got {other:?}"),
        }
        assert_eq!(cfg.parameters["a"].string_value, "b");
    }

    #[test]
    fn the_config_maps_to_triton_style_json() {
        let c = parse_model_config(
            "m",
            r#"name: "m" max_batch_size: 8
               input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 4 ] } ]
               dynamic_batching { max_queue_delay_microseconds: 100 }"#,
        )
        .unwrap();
        let j = model_config_json(&c);
        assert_eq!(j["name"], "m");
        assert_eq!(j["max_batch_size"], 8);
        assert_eq!(j["input"][0]["data_type"], "TYPE_FP32");
        assert_eq!(j["input"][0]["dims"], serde_json::json!(["3", "4"]));
        assert_eq!(j["dynamic_batching"]["max_queue_delay_microseconds"], "100");
        assert_eq!(j["platform"], "", "fields at their default are present");
    }

    #[test]
    fn unknown_field_is_a_parse_error_naming_the_field_and_model() {
        let err = parse_model_config("m", "name: \"m\"\nmax_batch_sise: 4\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("model 'm'"), "{msg}");
        assert!(msg.contains("max_batch_sise"), "{msg}");
    }

    #[test]
    fn message_lists_without_colon_parse_and_strings_are_untouched() {
        let cfg = parse_model_config(
            "m",
            "# input [ in a comment\nname: \"a [b\"\ninput [ { name: \"x\" dims [ 1, 2 ] } ]\ninstance_group[{kind: KIND_CPU}]",
        )
        .unwrap();
        assert_eq!(cfg.name, "a [b");
        assert_eq!(cfg.input[0].dims, vec![1, 2]);
        assert_eq!(cfg.instance_group.len(), 1);
    }

    #[test]
    fn error_positions_refer_to_the_original_text() {
        let err = parse_model_config("m", "input [ { name: \"x\" } ]\nmax_batch_size: oops\n")
            .unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
    }

    #[test]
    fn wrong_value_type_is_a_parse_error() {
        let err = parse_model_config("m", "max_batch_size: \"eight\"").unwrap_err();
        assert!(matches!(err, RepositoryError::Parse { .. }), "{err}");
    }
}
