//! TFRecord framing, the container of TensorBoard event files: each record is its length
//! (u64, little endian), the masked CRC-32C of those 8 bytes (u32), the data, and the masked
//! CRC-32C of the data (u32). [`frame`] makes one record; [`records`] splits a file's bytes into
//! its records' data, verifying both checksums of each.

/// TensorBoard's mask: a rotated CRC plus a constant, so that a CRC of data holding CRCs
/// stays well distributed.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `data` as one record.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let length = (data.len() as u64).to_le_bytes();
    let mut record = Vec::with_capacity(data.len() + 16);
    record.extend_from_slice(&length);
    record.extend_from_slice(&masked_crc(&length).to_le_bytes());
    record.extend_from_slice(data);
    record.extend_from_slice(&masked_crc(data).to_le_bytes());
    record
}

/// A record that is not whole or whose checksum does not match, at byte `offset` (where the
/// record starts).
#[derive(Debug, PartialEq)]
pub struct Corrupt {
    pub offset: usize,
    pub what: String,
}

/// Each record's data and the offset its record starts at, in file order.
pub fn records(bytes: &[u8]) -> Result<Vec<(usize, &[u8])>, Corrupt> {
    let mut out = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let rest = &bytes[offset..];
        let corrupt = |what: String| Corrupt { offset, what };
        let (Some(length), Some(length_crc)) = (rest.get(..8), rest.get(8..12)) else {
            return Err(corrupt(format!(
                "a record header needs 12 bytes, {} are left (a truncated file)",
                rest.len()
            )));
        };
        if u32_le(length_crc) != masked_crc(length) {
            return Err(corrupt(
                "the checksum of the record's length does not match".into(),
            ));
        }
        let size = u64_le(length);
        let end = usize::try_from(size)
            .ok()
            .and_then(|size| size.checked_add(16))
            .filter(|&end| end <= rest.len())
            .ok_or_else(|| {
                corrupt(format!(
                    "the record's {size} bytes run past the end of the file (a truncated file)"
                ))
            })?;
        let data = &rest[12..end - 4];
        if u32_le(&rest[end - 4..end]) != masked_crc(data) {
            return Err(corrupt(
                "the checksum of the record's data does not match".into(),
            ));
        }
        out.push((offset, data));
        offset += end;
    }
    Ok(out)
}

fn u32_le(bytes: &[u8]) -> u32 {
    let mut word = [0; 4];
    word.copy_from_slice(bytes);
    u32::from_le_bytes(word)
}

fn u64_le(bytes: &[u8]) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(bytes);
    u64::from_le_bytes(word)
}
