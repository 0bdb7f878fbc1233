//! Scalars for `--tensorboard_dir`, written as a TensorBoard event file without a TensorBoard
//! or TensorFlow dependency: the file is a TFRecord stream of `Event` messages, and a scalar
//! event needs only three small messages, declared here with their `.proto` field numbers.
//!
//! Record framing (TFRecord): u64 LE length, u32 masked CRC-32C of those 8 bytes, the data,
//! u32 masked CRC-32C of the data.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message as _;

/// The first record of every event file; TensorBoard reads it to know the format version.
const FILE_VERSION: &str = "brain.Event:2";

/// CRC-32C (Castagnoli), reflected polynomial: the checksum TFRecord uses.
const CRC32C_POLY: u32 = 0x82F6_3B78;

const CRC32C_TABLE: [u32; 256] = crc32c_table();

const fn crc32c_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ CRC32C_POLY
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
}

fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC32C_TABLE[((crc ^ u32::from(b)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord stores CRCs rotated and offset, so a CRC computed over data that itself holds
/// CRCs does not degenerate.
fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: the framed bytes for `data`.
fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// The messages of tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto
/// this writer needs, with their field numbers and types; the fields left out are never set.
///
/// Every field has presence (`optional`, or a oneof as in the `.proto`), so a zero or an
/// empty value is still written: the bytes stay those this writer has always produced, and
/// a step 0 or a loss of 0 reads back as written rather than as a default.
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Event {
        #[prost(double, optional, tag = "1")]
        pub wall_time: Option<f64>,
        #[prost(int64, optional, tag = "2")]
        pub step: Option<i64>,
        #[prost(oneof = "What", tags = "3, 5")]
        pub what: Option<What>,
    }

    /// `Event.what`: the file's first event says the format, every later one a summary.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum What {
        #[prost(string, tag = "3")]
        FileVersion(String),
        #[prost(message, tag = "5")]
        Summary(Summary),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Summary {
        #[prost(message, repeated, tag = "1")]
        pub value: Vec<Value>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Value {
        #[prost(string, optional, tag = "1")]
        pub tag: Option<String>,
        #[prost(float, optional, tag = "2")]
        pub simple_value: Option<f32>,
    }
}

/// The `Event` that opens a file: wall_time and file_version.
fn file_version_event(wall_time: f64) -> Vec<u8> {
    proto::Event {
        wall_time: Some(wall_time),
        step: None,
        what: Some(proto::What::FileVersion(FILE_VERSION.to_string())),
    }
    .encode_to_vec()
}

/// An `Event` holding one scalar: wall_time, step, summary { value { tag, simple_value } }.
fn scalar_event(wall_time: f64, step: u64, tag: &str, value: f32) -> Vec<u8> {
    let summary = proto::Summary {
        value: vec![proto::Value {
            tag: Some(tag.to_string()),
            simple_value: Some(value),
        }],
    };
    proto::Event {
        wall_time: Some(wall_time),
        // step is an int64 on the wire: a u64 past i64::MAX would read back negative.
        step: Some(i64::try_from(step).unwrap_or(i64::MAX)),
        what: Some(proto::What::Summary(summary)),
    }
    .encode_to_vec()
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The host part of the file name TensorBoard's own writers use; no libc call needed on Linux.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty() && !h.contains('/'))
        .unwrap_or_else(|| "localhost".to_string())
}

/// `events.out.tfevents.<unix seconds>.<hostname>.<pid>`: the name `tensorboard --logdir`
/// looks for; seconds, host and pid keep writers sharing a directory apart.
fn event_file_name(unix_seconds: u64, host: &str, pid: u32) -> String {
    format!("events.out.tfevents.{unix_seconds}.{host}.{pid}")
}

/// Appends scalars to one new event file.
///
/// Every `scalar` call is flushed to the file before it returns: the trainer logs a handful
/// of scalars per log interval, so a `write(2)` each costs nothing next to a step, while the
/// agent stops workers with signals under which no destructor runs; a buffer kept until
/// drop would lose every scalar since the last flush, flushing each loses none.
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` (and its parents) and a new event file in it, opened by the
    /// file_version record.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let wall_time = now_seconds();
        let name = event_file_name(wall_time as u64, &hostname(), std::process::id());
        let path = dir.join(name);
        // create_new: never append to, or truncate, another writer's file.
        let file = File::options().write(true).create_new(true).open(&path)?;
        let mut writer = Self {
            file: BufWriter::new(file),
            path,
        };
        writer.write_record(&file_version_event(wall_time))?;
        writer.file.flush()?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `value` under `tag` at `step` (stored as a 32-bit float, as TensorBoard does).
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64) -> std::io::Result<()> {
        self.write_record(&scalar_event(now_seconds(), step, tag, value as f32))?;
        self.file.flush()
    }

    fn write_record(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all(&frame_record(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TFRecord reader that checks both CRCs, so a test can tell a good file from a bad one.
    #[derive(Debug, PartialEq)]
    enum ReadError {
        Truncated { at: usize },
        LengthCrc { at: usize },
        DataCrc { at: usize },
    }

    fn read_records(mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        let mut records = Vec::new();
        let mut at = 0;
        while !bytes.is_empty() {
            let Some((head, rest)) = bytes.split_at_checked(12) else {
                return Err(ReadError::Truncated { at });
            };
            let (len_bytes, len_crc) = head.split_at(8);
            if masked_crc32c(len_bytes).to_le_bytes() != len_crc {
                return Err(ReadError::LengthCrc { at });
            }
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let Some((data, rest)) = rest.split_at_checked(len) else {
                return Err(ReadError::Truncated { at });
            };
            let Some((data_crc, rest)) = rest.split_at_checked(4) else {
                return Err(ReadError::Truncated { at });
            };
            if masked_crc32c(data).to_le_bytes() != data_crc {
                return Err(ReadError::DataCrc { at });
            }
            records.push(data.to_vec());
            at += 16 + len;
            bytes = rest;
        }
        Ok(records)
    }

    #[derive(Debug, Default, PartialEq)]
    struct Event {
        wall_time: f64,
        step: i64,
        file_version: Option<String>,
        values: Vec<(String, f32)>,
    }

    fn decode_event(bytes: &[u8]) -> Event {
        let decoded = proto::Event::decode(bytes).expect("not an Event");
        let mut event = Event {
            wall_time: decoded.wall_time.expect("Event without wall_time"),
            step: decoded.step.unwrap_or_default(),
            ..Event::default()
        };
        match decoded.what {
            Some(proto::What::FileVersion(v)) => event.file_version = Some(v),
            Some(proto::What::Summary(summary)) => {
                event.values = summary
                    .value
                    .into_iter()
                    .map(|v| {
                        (
                            v.tag.expect("Value without tag"),
                            v.simple_value.expect("Value without simple_value"),
                        )
                    })
                    .collect();
            }
            None => panic!("Event with neither file_version nor summary"),
        }
        event
    }

    /// The one event file in `dir`, its name and bytes.
    fn only_event_file(dir: &Path) -> (String, Vec<u8>) {
        let entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(entries.len(), 1, "{entries:?}");
        let name = entries[0]
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        (name, std::fs::read(&entries[0]).unwrap())
    }

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, and of 0xFF.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn masked_crc_rotates_and_offsets() {
        // ((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xa282ead8 (mod 2^32), worked out apart.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn varints_match_the_protobuf_encoding() {
        let enc = |v| {
            let mut out = Vec::new();
            prost::encoding::encode_varint(v, &mut out);
            out
        };
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(1), [0x01]);
        assert_eq!(enc(150), [0x96, 0x01]);
        assert_eq!(enc(300), [0xAC, 0x02]);
        assert_eq!(enc(u64::MAX).len(), 10);
    }

    #[test]
    fn a_scalar_event_has_the_documented_bytes() {
        // Hand-assembled from event.proto: a check independent of the test's decoder.
        let tag = b"loss";
        let mut expected = vec![0x09]; // field 1, fixed64
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 0x07]); // field 2, varint 7
        expected.extend_from_slice(&[0x2A, 13]); // field 5, 13 bytes: Summary
        expected.extend_from_slice(&[0x0A, 11]); // Summary.value, 11 bytes: Value
        expected.extend_from_slice(&[0x0A, 4]); // Value.tag, 4 bytes
        expected.extend_from_slice(tag);
        expected.push(0x15); // Value.simple_value, fixed32
        expected.extend_from_slice(&2.25f32.to_le_bytes());
        assert_eq!(scalar_event(1.5, 7, "loss", 2.25), expected);
    }

    #[test]
    fn a_zero_step_and_value_are_still_on_the_wire() {
        let mut expected = vec![0x09]; // field 1, fixed64
        expected.extend_from_slice(&0f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 0x00]); // field 2, varint 0
        expected.extend_from_slice(&[0x2A, 10, 0x0A, 8]); // Summary { Value, 8 bytes }
        expected.extend_from_slice(&[0x0A, 1, b't', 0x15]); // tag "t", simple_value
        expected.extend_from_slice(&0f32.to_le_bytes());
        assert_eq!(scalar_event(0.0, 0, "t", 0.0), expected);
    }

    #[test]
    fn scalars_round_trip_through_the_event_file() {
        let dir = tempfile::tempdir().unwrap();
        let logdir = dir.path().join("runs/a");
        let scalars = [
            ("train/loss", 0, 10.5),
            ("train/lr", 0, 3e-4),
            ("train/samples_per_s", 10, 1234.5),
            ("val/loss", 1 << 40, -0.125),
            ("train/loss", u64::MAX, f64::INFINITY),
        ];
        let before = now_seconds();
        {
            let mut w = EventWriter::create(&logdir).unwrap();
            for (tag, step, value) in scalars {
                w.scalar(tag, step, value).unwrap();
            }
        }
        let after = now_seconds();

        let (name, bytes) = only_event_file(&logdir);
        let host_pid = format!(".{}.{}", hostname(), std::process::id());
        assert!(
            name.starts_with("events.out.tfevents.") && name.ends_with(&host_pid),
            "{name}"
        );

        let events: Vec<Event> = read_records(&bytes)
            .unwrap()
            .iter()
            .map(|r| decode_event(r))
            .collect();
        assert_eq!(events.len(), 1 + scalars.len());
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert!(events[0].values.is_empty());
        for (event, (tag, step, value)) in events[1..].iter().zip(scalars) {
            assert_eq!(event.file_version, None);
            assert_eq!(event.step, step.min(i64::MAX as u64) as i64);
            assert_eq!(event.values, [(tag.to_string(), value as f32)]);
        }
        let times: Vec<f64> = events.iter().map(|e| e.wall_time).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
        assert!(
            before - 1.0 <= times[0] && times[times.len() - 1] <= after + 1.0,
            "{times:?}"
        );
    }

    #[test]
    fn each_scalar_is_on_disk_before_the_writer_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalar("train/loss", 3, 2.5).unwrap();
        // Read while the writer is alive, as after a SIGKILL: nothing may still sit in a buffer.
        let records = read_records(&std::fs::read(w.path()).unwrap()).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(
            decode_event(&records[1]).values,
            [("train/loss".to_string(), 2.5)]
        );
    }

    #[test]
    fn a_truncated_or_corrupted_record_is_detected() {
        let mut bytes = frame_record(&file_version_event(1.0));
        let second_at = bytes.len();
        bytes.extend(frame_record(&scalar_event(2.0, 1, "train/loss", 1.0)));
        assert_eq!(read_records(&bytes).unwrap().len(), 2);

        // Cut inside the second record's data, its trailing CRC, and its header.
        for cut in [bytes.len() - 10, bytes.len() - 1, second_at + 5] {
            assert_eq!(
                read_records(&bytes[..cut]),
                Err(ReadError::Truncated { at: second_at })
            );
        }
        let mut flipped = bytes.clone();
        flipped[second_at + 20] ^= 1;
        assert_eq!(
            read_records(&flipped),
            Err(ReadError::DataCrc { at: second_at })
        );
        let mut flipped = bytes.clone();
        flipped[second_at] ^= 1;
        assert_eq!(
            read_records(&flipped),
            Err(ReadError::LengthCrc { at: second_at })
        );
    }

    #[test]
    fn create_fails_where_the_directory_cannot_be() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        assert!(EventWriter::create(&file).is_err());
    }

    #[test]
    fn file_names_follow_tensorboards_pattern() {
        assert_eq!(
            event_file_name(1700000000, "node-3", 4242),
            "events.out.tfevents.1700000000.node-3.4242"
        );
    }
}
